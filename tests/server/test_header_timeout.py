"""`loom serve --timeout-header`: a client that does not send its request head in time is answered 408 and
disconnected (slowloris), while other clients are served; a slow body after a complete head is not cut."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from loom.server.header_timeout import http_protocol
from tests.server.conftest import LiveServer, make_fake_front, serve

TIMEOUT_S = 0.6


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    front, _ = make_fake_front()
    with serve(front, uvicorn_kwargs={"http": http_protocol(TIMEOUT_S), "timeout_keep_alive": 30}) as server:
        yield server


def _connect(live: LiveServer) -> tuple[socket.socket, float]:
    """A connection, and the time just before it opened (the server's timer starts after it)."""
    t0 = time.monotonic()
    return socket.create_connection(("127.0.0.1", int(live.base_url.rsplit(":", 1)[1])), timeout=10), t0


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _assert_closed_with_408(sock: socket.socket, t0: float) -> None:
    data = _read_until_closed(sock)
    waited = time.monotonic() - t0
    assert TIMEOUT_S <= waited < TIMEOUT_S + 2.5, waited  # slack: 2 cores shared with other jobs
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_dripped_head_is_cut_while_another_client_is_served(live: LiveServer) -> None:
    slow, t0 = _connect(live)
    with slow, httpx.Client(base_url=live.base_url) as other:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.settimeout(0.1)
        served = 0
        try:
            for i in range(100):  # slowloris: a header line every 0.1 s, never the blank line that ends the head
                slow.sendall(f"X-Drip-{i}: a\r\n".encode())
                assert other.get("/health").status_code == 200  # meanwhile, others are served at once
                served += 1
                try:
                    if slow.recv(65536, socket.MSG_PEEK):
                        break  # the server has answered
                except TimeoutError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass
        slow.settimeout(10)
        _assert_closed_with_408(slow, t0)
        assert served >= 3


def test_a_silent_connection_is_closed(live: LiveServer) -> None:
    silent, t0 = _connect(live)
    with silent:
        _assert_closed_with_408(silent, t0)


def test_a_kept_alive_connection_gets_the_bound_for_each_head(live: LiveServer) -> None:
    sock, _ = _connect(live)
    with sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole response (head and body may come apart)
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        time.sleep(TIMEOUT_S * 1.5)  # idle between requests: the keep-alive timeout (30 s) governs, not this one
        t0 = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a next request's head, never finished
        _assert_closed_with_408(sock, t0)


def test_a_slow_body_after_a_whole_head_is_not_cut(live: LiveServer) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    sock, _ = _connect(live)
    with sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 8):  # the body over about twice the header timeout
            time.sleep(TIMEOUT_S * 2 / (len(body) / 8))
            sock.sendall(body[i:i + 8])
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200"), reply


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_the_option_is_checked(value: float) -> None:
    with pytest.raises(ValueError, match="timeout_header must be a finite number > 0"):
        http_protocol(value)


def test_loom_serve_has_the_option_with_a_default() -> None:
    from loom.cli import build_parser

    assert build_parser().parse_args(["serve"]).timeout_header == 30.0
    assert build_parser().parse_args(["serve", "--timeout-header", "2.5"]).timeout_header == 2.5
