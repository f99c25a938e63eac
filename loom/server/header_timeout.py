"""A bound on the time a client may take to send a request head (a slowloris guard), which uvicorn lacks.

uvicorn times out only idle keep-alive connections (`--timeout-keep-alive`, armed after a response and cancelled
by any byte received): a connection that opens and sends nothing, or sends a head one byte at a time, holds its
socket and file descriptor forever, so a few thousand of them exhaust the server. `HeaderTimeoutProtocol` is
uvicorn's h11 protocol plus one timer: armed when a connection opens and when the first byte of a next request
arrives on a kept-alive one, disarmed once h11 has parsed the whole head (request line and headers). When it
fires the client gets a 408 in OpenAI's error shape and the connection is closed. The body is not covered: a
large upload may take its time once its head has arrived (`--max-request-bytes` bounds its size).

`loom serve --timeout-header S` selects it (default 30 s; nginx's client_header_timeout is 60 s). It replaces
uvicorn's "auto" protocol choice, which is h11 unless httptools is installed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_HEADER_S = 30.0


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"The request head (request line and headers) did not arrive within "
                                            f"{seconds:g} s.", "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's H11Protocol with a deadline of `timeout_header` seconds for each request head."""

    def __init__(self, *args: Any, timeout_header: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeout_header = timeout_header  # seconds from a connection's opening or a request's first byte
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # h11 has the whole head (or gave up on the connection)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._timeout_header, self._on_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.debug("closing a connection from %s: no request head within %g s", self.client, self._timeout_header)
        self.transport.write(_timeout_response(self._timeout_header))
        self.transport.close()


def http_protocol(timeout_header: float) -> Any:
    """The `http` argument of uvicorn.Config for a server with this header timeout (seconds).

    Raises:
        ValueError: a timeout that is not a finite number > 0.
    """
    if not (math.isfinite(timeout_header) and timeout_header > 0):
        raise ValueError(f"timeout_header must be a finite number > 0, got {timeout_header}")
    return functools.partial(HeaderTimeoutProtocol, timeout_header=timeout_header)


__all__ = ["DEFAULT_TIMEOUT_HEADER_S", "HeaderTimeoutProtocol", "http_protocol"]
