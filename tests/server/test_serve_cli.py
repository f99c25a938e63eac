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


def _serve_ns(*args: str):
    from loom.cli import build_parser

    return build_parser().parse_args(["serve", *args])


def test_security_options_and_the_api_key_environment_variable() -> None:
    from loom.server.cli import security_config

    assert security_config(_serve_ns(), {}).api_key is None
    assert security_config(_serve_ns(), {"LOOM_API_KEY": "from-env"}).api_key == "from-env"
    config = security_config(_serve_ns("--api-key", "flag", "--allowed-origins", "http://a", "http://b",
                                       "--allowed-hosts", "localhost", "--max-request-bytes", "100"),
                             {"LOOM_API_KEY": "from-env"})
    assert (config.api_key, config.allowed_origins, config.allowed_hosts, config.max_request_bytes) == (
        "flag", ["http://a", "http://b"], ["localhost"], 100)
    with pytest.raises(ValueError, match="max_request_bytes must be >= 1"):
        security_config(_serve_ns("--max-request-bytes", "0"), {})
    with pytest.raises(ValueError, match="timeout_keep_alive must be > 0"):
        security_config(_serve_ns("--timeout-keep-alive", "0"), {})
    with pytest.raises(ValueError, match="api_key must not be empty"):
        security_config(_serve_ns("--api-key", ""), {})
