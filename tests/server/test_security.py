"""API key, CORS, trusted hosts and the body limit (loom/server/security.py) on a live server."""

from __future__ import annotations

import socket

import httpx
import pytest

from loom.server.security import SecurityConfig
from tests.server.conftest import make_fake_front, serve

COMPLETION = {"prompt": "hello", "max_tokens": 2}


def test_api_key_guards_every_route_but_health() -> None:
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front, security=SecurityConfig(api_key="s3cret")) as live, \
            httpx.Client(base_url=live.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
                                   ("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "x"})]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}]:
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            ok = c.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200, (path, ok.text)
        # the openai client sends the key as a bearer token
        from openai import OpenAI

        assert OpenAI(base_url=live.v1, api_key="s3cret").models.list().data
        with pytest.raises(Exception, match="401"):
            OpenAI(base_url=live.v1, api_key="nope", max_retries=0).models.list()


def test_no_cors_by_default_and_listed_origins_only() -> None:
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=30) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = c.post("/v1/completions", json=COMPLETION, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front, security=SecurityConfig(api_key="k", allowed_origins=["http://app.example"])) as live, \
            httpx.Client(base_url=live.base_url, timeout=30) as c:
        r = c.options("/v1/completions", headers=preflight)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.post("/v1/completions", json=COMPLETION,
                   headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"


def test_trusted_hosts() -> None:
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front, security=SecurityConfig(allowed_hosts=["localhost", "127.0.0.1"])) as live, \
            httpx.Client(base_url=live.base_url, timeout=30) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"Host": "attacker.example"}).status_code == 400


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and b"request_too_large" in data:
                break
        return data


def test_body_limit_refuses_large_bodies_and_keeps_serving() -> None:
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front, security=SecurityConfig(max_request_bytes=2000)) as live, \
            httpx.Client(base_url=live.base_url, timeout=30) as c:
        big = {"prompt": "x " * 2000, "max_tokens": 1}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # no Content-Length (chunked): refused once the stream passes the limit
        port = int(live.base_url.rsplit(":", 1)[1])
        chunk = b"x" * 1500
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(chunk) + chunk + b"\r\n"
               + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
        assert b" 413 " in _raw(port, req).split(b"\r\n", 1)[0]
        # a body under the limit, chunked, still works
        small = b'{"prompt": "hi", "max_tokens": 2}'
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"%x\r\n" % len(small) + small
               + b"\r\n0\r\n\r\n")
        assert b" 200 " in _raw(port, req).split(b"\r\n", 1)[0]
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize(("kwargs", "match"), [({"api_key": " "}, "api_key"), ({"max_request_bytes": 0}, "max_request"),
                                               ({"allowed_hosts": []}, "allowed_hosts")])
def test_security_config_refuses_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SecurityConfig(**kwargs)
