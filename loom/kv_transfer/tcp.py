"""A KVConnector over plain TCP: the producer serves its pinned blocks from a thread, the consumer pulls them.

Wire format (one exchange per connection):
  consumer -> producer: one JSON line, {"op": "read" | "release", "transfer_id": str, "num_blocks": int}
  producer -> consumer: a 4-byte big-endian length, a JSON header {"ok": bool, "error": str, "layout": {...},
                        "num_blocks": int, "nbytes": int}, then nbytes raw bytes (KVPayload layout).
The header comes before the bytes so the consumer checks the layout on arrival and refuses a mismatch without
loading anything. A read releases the transfer on the producer whether or not the consumer keeps the bytes.
Reading pinned blocks while the engine thread writes other blocks is safe: pinned blocks are never handed out.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from typing import Any

from loom.kv_transfer.base import (KVBlockSource, KVLayout, KVPayload, KVTransferError,
                                   KVTransferParams)

logger = logging.getLogger(__name__)

MAX_REQUEST_LINE = 1 << 16  # bytes of a consumer's request line
MAX_HEADER = 1 << 20  # bytes of a producer's JSON header
_LEN = struct.Struct(">I")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a consumer that hangs must not keep the process alive
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], source: KVBlockSource) -> None:
        self.source = source  # the engine's pinned blocks
        super().__init__(address, _Handler)


class _Handler(socketserver.StreamRequestHandler):
    timeout = 60.0  # seconds a consumer may take to send its request or read the answer

    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        try:
            line = self.rfile.readline(MAX_REQUEST_LINE)
            ask = json.loads(line)
            op, transfer_id = ask["op"], str(ask["transfer_id"])
        except (ValueError, KeyError, TypeError, OSError) as e:
            self._answer({"ok": False, "error": f"bad request: {e}"})
            return
        if op == "release":
            server.source.release_pinned(transfer_id)
            self._answer({"ok": True, "nbytes": 0})
            return
        if op != "read":
            self._answer({"ok": False, "error": f"unknown op {op!r}"})
            return
        try:
            data = server.source.read_pinned(transfer_id, int(ask["num_blocks"]))
        except KeyError:
            self._answer({"ok": False, "error": f"unknown or expired transfer {transfer_id!r}"})
            return
        except (ValueError, TypeError) as e:
            self._answer({"ok": False, "error": str(e)})
            return
        self._answer({"ok": True, "layout": server.source.layout.to_dict(), "num_blocks": int(ask["num_blocks"]),
                      "nbytes": len(data)}, data)

    def _answer(self, header: dict[str, Any], data: bytes = b"") -> None:
        raw = json.dumps(header).encode()
        try:
            self.wfile.write(_LEN.pack(len(raw)) + raw)
            if data:
                self.wfile.write(data)
        except OSError as e:  # the consumer left (a refused layout, a timeout): its fallback recomputes
            logger.debug("KV transfer answer not delivered: %s", e)


class TCPConnector:
    """KVConnector over TCP sockets (see the module docstring for the wire format)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """host, port: where a producer listens (port 0 = any free port); unused by a pure consumer."""
        self.host = host  # producer listen address
        self.port = port  # producer listen port; the bound one after start_producer
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start_producer(self, source: KVBlockSource) -> tuple[str, int]:
        """Listen on (host, port) and serve `source` from a daemon thread (one more per connection).

        Raises:
            OSError: the address cannot be bound (port in use).
            RuntimeError: already started.
        """
        if self._server is not None:
            raise RuntimeError("the KV transfer server is already running")
        self._server = _Server((self.host, self.port), source)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="loom-kv-transfer", daemon=True)
        self._thread.start()
        return self.host, self.port

    def pull(self, params: KVTransferParams, num_blocks: int, local: KVLayout, timeout_s: float) -> KVPayload:
        """Fetch the first num_blocks blocks of a transfer within timeout_s seconds in all.

        Raises:
            KVLayoutMismatchError: the producer's layout differs from `local` (nothing is read past the header).
            KVTransferError: the producer cannot be reached, refuses, is too slow, or sends too few bytes.
        """
        deadline = time.monotonic() + timeout_s
        ask = {"op": "read", "transfer_id": params.transfer_id, "num_blocks": num_blocks}
        try:
            with socket.create_connection((params.remote_host, params.remote_port), timeout=timeout_s) as sock:
                sock.sendall(json.dumps(ask).encode() + b"\n")
                header = _read_header(sock, deadline)
                if not header.get("ok"):
                    raise KVTransferError(f"producer refused: {header.get('error')}")
                layout = KVLayout.from_dict(header.get("layout"), "layout")
                layout.check_matches(local)
                nbytes = int(header["nbytes"])
                if nbytes != num_blocks * layout.block_bytes:
                    raise KVTransferError(f"producer offers {nbytes} bytes for {num_blocks} blocks of "
                                          f"{layout.block_bytes}")
                data = _read_exactly(sock, nbytes, deadline)
        except KVTransferError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KVTransferError(f"KV pull from {params.remote_host}:{params.remote_port} failed: {e}") from e
        return KVPayload(layout=layout, num_blocks=num_blocks, data=data)

    def release(self, params: KVTransferParams, timeout_s: float) -> None:
        """Ask the producer to free a transfer unread; failures are logged only (its timeout frees it anyway)."""
        ask = {"op": "release", "transfer_id": params.transfer_id, "num_blocks": 0}
        try:
            with socket.create_connection((params.remote_host, params.remote_port), timeout=timeout_s) as sock:
                sock.sendall(json.dumps(ask).encode() + b"\n")
                _read_header(sock, time.monotonic() + timeout_s)
        except (OSError, ValueError) as e:
            logger.debug("KV release of %s not delivered: %s", params.transfer_id, e)

    def close(self) -> None:
        """Stop the server thread (producer); idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _read_header(sock: socket.socket, deadline: float) -> dict[str, Any]:
    (length,) = _LEN.unpack(_read_exactly(sock, _LEN.size, deadline))
    if length > MAX_HEADER:
        raise ValueError(f"header of {length} bytes")
    header = json.loads(_read_exactly(sock, length, deadline))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return header


def _read_exactly(sock: socket.socket, nbytes: int, deadline: float) -> bytearray:
    """nbytes from the socket before `deadline` (time.monotonic seconds). Raises KVTransferError."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransferError(f"timed out after {got} of {nbytes} bytes")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:], nbytes - got)
        except TimeoutError as e:
            raise KVTransferError(f"timed out after {got} of {nbytes} bytes") from e
        if n == 0:
            raise KVTransferError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return buf


__all__ = ["TCPConnector"]
