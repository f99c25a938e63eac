"""`loom serve` start-up checks that must fail before the model loads."""

from __future__ import annotations

import socket

import pytest

from loom.server.cli import check_listen_address


def test_a_busy_port_is_refused_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_listen_address("127.0.0.1", port)
    check_listen_address("127.0.0.1", port)  # free again: accepted


def test_a_bad_host_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot listen on 999.1.1.1"):
        check_listen_address("999.1.1.1", 8000)
