"""The router end to end over fake-engine replicas: forwarding (plain and streamed), model and replica
filtering, draining, admin routes, metrics, and failover when a replica dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from loom.router.replica import check_replica_url
from tests.router.conftest import live_router, replica_processes
from tests.server.conftest import LiveServer, make_fake_front, serve, wait_for

BODY = {"model": "fake-model", "prompt": "hello router", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def two_replicas() -> Iterator[list[LiveServer]]:
    front_a, _ = make_fake_front(step_delay_s=0.002)
    front_b, _ = make_fake_front(step_delay_s=0.002)
    with serve(front_a) as a, serve(front_b) as b:
        yield [a, b]


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _sse_payloads(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def test_a_request_through_the_router_equals_one_sent_to_a_replica(two_replicas: list[LiveServer]) -> None:
    with live_router([r.base_url for r in two_replicas], policy="round_robin") as (url, _):
        direct = httpx.post(two_replicas[0].base_url + "/v1/completions", json=BODY, timeout=30)
        seen = set()
        for _ in range(2):
            routed = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
            assert routed.status_code == 200
            assert _strip(routed.json()) == _strip(direct.json())
            seen.add(routed.headers["x-loom-replica"])
        assert seen == {r.base_url for r in two_replicas}  # round robin used both
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "stream": True}
        direct_chunks = _sse_payloads(httpx.post(two_replicas[1].base_url + "/v1/chat/completions", json=chat,
                                                 timeout=30).text)
        routed = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
        assert routed.headers["content-type"].startswith("text/event-stream")
        routed_chunks = _sse_payloads(routed.text)
        assert routed_chunks[-1] == "[DONE]" and len(routed_chunks) == len(direct_chunks)
        for a, b in zip(routed_chunks[:-1], direct_chunks[:-1]):
            assert _strip(json.loads(a)) == _strip(json.loads(b))


def test_models_health_load_and_errors(two_replicas: list[LiveServer]) -> None:
    load = httpx.get(two_replicas[0].base_url + "/load", timeout=10).json()
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage"} <= set(load)
    with live_router([r.base_url for r in two_replicas]) as (url, _):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["fake-model"]
        assert httpx.get(url + "/health").status_code == 200
        missing = httpx.post(url + "/v1/completions", json={**BODY, "model": "no-such-model"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        bad = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                         timeout=10)
        assert bad.status_code == 400 and "Malformed JSON" in bad.json()["error"]["message"]
        # a replica's own 400 passes through unchanged, and is not retried elsewhere
        invalid = httpx.post(url + "/v1/completions", json={**BODY, "temperature": -1}, timeout=10)
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "temperature"
        metrics = httpx.get(url + "/metrics").text
        assert 'loom_router:requests_total{replica=' in metrics and "loom_router:routing_decisions_total" in metrics
    with live_router(["http://127.0.0.1:9"]) as (url, _):  # nothing listens on port 9
        assert httpx.get(url + "/health").status_code == 503
        down = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert down.status_code == 503 and down.json()["error"]["code"] == "no_replica"
    with pytest.raises(ValueError, match="replica"):
        check_replica_url("ftp://x")


def test_draining_and_admin_routes(two_replicas: list[LiveServer]) -> None:
    a, b = (r.base_url for r in two_replicas)
    with live_router([a], policy="round_robin") as (url, router):
        added = httpx.post(url + "/router/add", json={"url": b}, timeout=10)
        assert added.status_code == 200 and added.json()["healthy"]
        assert httpx.post(url + "/router/add", json={"url": b}, timeout=10).status_code == 400
        assert httpx.post(url + "/router/drain", json={"url": a}, timeout=10).json()["draining"]
        replicas = {httpx.post(url + "/v1/completions", json=BODY, timeout=30).headers["x-loom-replica"]
                    for _ in range(4)}
        assert replicas == {b}  # a drained replica gets no new requests
        httpx.post(url + "/router/undrain", json={"url": a}, timeout=10)
        httpx.post(url + "/router/remove", json={"url": b}, timeout=10)
        listed = httpx.get(url + "/router/replicas").json()["replicas"]
        assert [r["url"] for r in listed] == [a] and not listed[0]["draining"]
        assert httpx.post(url + "/router/remove", json={"url": b}, timeout=10).status_code == 400
        assert httpx.post(url + "/router/drain", json={}, timeout=10).json()["error"]["param"] == "url"


def test_failover_while_the_router_runs(two_replicas: list[LiveServer]) -> None:
    good = two_replicas[0].base_url
    front_closed, _ = make_fake_front(step_delay_s=0.002)
    front_stopped, _ = make_fake_front(step_delay_s=0.002)
    closed_ctx = serve(front_closed)
    closed = closed_ctx.__enter__()
    with serve(front_stopped) as stopped:
        urls = [good, closed.base_url, stopped.base_url]
        with live_router(urls, policy="round_robin", health_interval_s=60) as (url, router):
            assert all(r.healthy for r in router.replicas)  # no check after the first one
            closed_ctx.__exit__(None, None, None)  # its port refuses connections from now on
            front_stopped.shutdown()  # its engine stops: its /v1 routes answer 503
            for _ in range(6):
                r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
                assert r.status_code == 200 and r.headers["x-loom-replica"] == good
            metrics = httpx.get(url + "/metrics").text
            assert 'loom_router:retries_total{cause="connect"}' in metrics
            assert 'loom_router:retries_total{cause="status_503"}' in metrics


def test_killing_a_replica_mid_run_loses_no_request_that_had_not_started_streaming() -> None:
    with replica_processes(2, step_delay_s=0.02) as procs:
        urls = [u for u, _ in procs]
        victim_url, victim = procs[1]
        with live_router(urls, policy="round_robin", health_interval_s=0.2) as (url, _):

            async def one(client: httpx.AsyncClient, i: int) -> tuple[bool, bool, str]:
                """(started streaming, completed, replica) of one streamed request."""
                body = {"model": "fake-model", "prompt": f"request {i}", "max_tokens": 40, "temperature": 0,
                        "stream": True}
                started = completed = False
                replica = ""
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200, await resp.aread()
                    replica = resp.headers["x-loom-replica"]
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        payload = json.loads(data)
                        if "error" in payload:
                            assert payload["error"]["code"] == "replica_failed"
                            continue
                        started = True
                        if payload["choices"][0].get("finish_reason") == "length":
                            completed = True
                return started, completed, replica

            async def run() -> list[tuple[bool, bool, str]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    tasks = [asyncio.create_task(one(client, i)) for i in range(8)]
                    await asyncio.sleep(0.3)  # some are streaming from the victim now
                    os.killpg(victim.pid, signal.SIGKILL)
                    tasks += [asyncio.create_task(one(client, 100 + i)) for i in range(8)]  # sent after the kill
                    return await asyncio.gather(*tasks)

            results = asyncio.run(run())
        cut = [r for r in results if not r[1]]
        assert all(r[2] == victim_url for r in cut)  # only the victim's streams can be cut ...
        assert all(r[0] for r in cut)  # ... and only those that had started streaming
        assert sum(r[1] for r in results[8:]) == 8  # every request sent after the kill completed elsewhere


def test_a_rolling_upgrade_pins_versions_and_drains_the_old_one() -> None:
    from loom.engine.model_identity import ModelIdentity

    old_front, old_fake = make_fake_front(step_delay_s=0.002)
    new_front, new_fake = make_fake_front(step_delay_s=0.002)
    new_fake.model_identity = ModelIdentity("fake-model", "1" * 64, "none", "float32", "float32", "0" * 64)
    with serve(old_front) as old, serve(new_front) as new:
        with live_router([old.base_url], policy="round_robin") as (url, router):
            old_version = router.replicas.get(old.base_url).identity
            new_version = new_fake.model_identity.digest
            assert old_version == old_fake.model_identity.digest != new_version
            httpx.post(url + "/router/add", json={"url": new.base_url}, timeout=10)
            pinned = {httpx.post(url + "/v1/completions", json={**BODY, "model": f"fake-model@{new_version[:12]}"},
                                 timeout=30).headers["x-loom-replica"] for _ in range(3)}
            assert pinned == {new.base_url}
            httpx.post(url + "/router/drain", json={"url": old.base_url}, timeout=10)
            assert {httpx.post(url + "/v1/completions", json=BODY, timeout=30).headers["x-loom-replica"]
                    for _ in range(3)} == {new.base_url}
            gone = httpx.post(url + "/v1/completions", json={**BODY, "model": f"fake-model@{old_version[:12]}"},
                              timeout=30)
            assert gone.status_code == 503 and old_version[:12] in gone.json()["error"]["message"]
            bad = httpx.post(url + "/v1/completions", json={**BODY, "model": "fake-model@xyz"}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
            unknown = httpx.post(url + "/v1/completions", json={**BODY, "model": "fake-model@0123abcd"}, timeout=30)
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_routing_alias_lets_the_model_selector_choose_the_model() -> None:
    small_front, _ = make_fake_front(step_delay_s=0.002)
    large_front, _ = make_fake_front(step_delay_s=0.002)
    with serve(small_front, served_model_name="tiny-135M") as small, \
            serve(large_front, served_model_name="big-1.5B") as large:
        with live_router([small.base_url, large.base_url], model_selector="length",
                         model_selector_options={"threshold": "40"}) as (url, _):
            ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
            assert ids == ["auto", "big-1.5B", "tiny-135M"]
            short = httpx.post(url + "/v1/completions", json={**BODY, "model": "auto", "prompt": "2+2="}, timeout=30)
            long = httpx.post(url + "/v1/completions", json={**BODY, "model": "auto", "prompt": "x" * 100},
                              timeout=30)
            assert short.json()["model"] == "tiny-135M" and short.headers["x-loom-replica"] == small.base_url
            assert long.json()["model"] == "big-1.5B" and long.headers["x-loom-replica"] == large.base_url
            named = httpx.post(url + "/v1/completions", json={**BODY, "model": "big-1.5B", "prompt": "2+2="},
                               timeout=30)
            assert named.headers["x-loom-replica"] == large.base_url  # a named model is never re-chosen
            assert 'loom_router:model_selections_total{model="tiny-135M",selector="length"} 1.0' in \
                httpx.get(url + "/metrics").text
            assert httpx.get(url + "/v1/models/big-1.5B").json()["id"] == "big-1.5B"  # models.retrieve
            assert httpx.get(url + "/v1/models/nope").json()["error"]["code"] == "model_not_found"
            pinned_alias = httpx.post(url + "/v1/completions", json={**BODY, "model": "auto@0123456789"}, timeout=30)
            assert pinned_alias.status_code == 400 and pinned_alias.json()["error"]["param"] == "model"
    real_front, _ = make_fake_front(step_delay_s=0.002)
    with serve(real_front, served_model_name="auto") as real, serve(small_front := make_fake_front()[0],
                                                                    served_model_name="tiny-135M") as small:
        with live_router([real.base_url, small.base_url], model_selector="length") as (url, _):
            # a replica's model named like the alias is a named model: never re-routed, listed once
            assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["auto", "tiny-135M"]
            r = httpx.post(url + "/v1/completions", json={**BODY, "model": "auto"}, timeout=30)
            assert r.headers["x-loom-replica"] == real.base_url


def test_a_client_that_leaves_a_non_streamed_request_aborts_it_at_the_replica() -> None:
    front, fake = make_fake_front(step_delay_s=0.02)
    with serve(front) as replica, live_router([replica.base_url]) as (url, router):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 200, "ignore_eos": True}, timeout=0.5)
        state = router.replicas.get(replica.base_url)
        assert wait_for(lambda: not fake.reqs and state.in_flight == 0, timeout_s=3.0), (fake.reqs, state.in_flight)
        assert fake.num_steps < 150  # aborted, not run to its 200 tokens


def test_unknown_routes_answer_in_the_openai_error_shape(two_replicas: list[LiveServer]) -> None:
    with live_router([two_replicas[0].base_url]) as (url, _):
        r = httpx.get(url + "/v1/embeddings")
        assert r.status_code in (404, 405) and r.json()["error"]["type"] == "invalid_request_error"


def test_clients_cannot_send_kv_transfer_params_and_admin_needs_its_key(two_replicas: list[LiveServer]) -> None:
    from loom.router.app import build_router_app
    from loom.router.replica import ReplicaSet
    from loom.router.router import Router, RouterConfig

    a = two_replicas[0].base_url
    with live_router([a]) as (url, _):
        r = httpx.post(url + "/v1/completions", json={**BODY, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"

    async def admin(app, client_host: str, headers: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=app, client=(client_host, 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return (await c.post("/router/drain", json={"url": a}, headers=headers)).status_code

    open_app = build_router_app(Router(ReplicaSet([a]), RouterConfig()))
    assert asyncio.run(admin(open_app, "127.0.0.1", {})) == 200  # no admin key: this machine only
    assert asyncio.run(admin(open_app, "10.1.2.3", {})) == 403
    keyed = build_router_app(Router(ReplicaSet([a]), RouterConfig()), admin_api_key="adm")
    assert asyncio.run(admin(keyed, "10.1.2.3", {})) == 401
    assert asyncio.run(admin(keyed, "10.1.2.3", {"X-Loom-Admin-Key": "adm"})) == 200


def test_replicas_with_an_api_key_are_checked_with_it() -> None:
    from loom.server.security import SecurityConfig

    front, _ = make_fake_front(step_delay_s=0.002)
    with serve(front, security=SecurityConfig(api_key="rk")) as keyed:
        with live_router([keyed.base_url]) as (_, router):
            assert not router.replicas.get(keyed.base_url).healthy  # /v1/models answers 401 without the key
        with live_router([keyed.base_url], replica_api_key="rk") as (url, router):
            assert router.replicas.get(keyed.base_url).healthy
            r = httpx.post(url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer rk"}, timeout=30)
            assert r.status_code == 200



def test_a_body_without_a_json_content_type_is_415_as_at_a_replica(two_replicas: list[LiveServer]) -> None:
    """The router parsed any body as JSON and forwarded it, where `loom serve` answers 415: the same request got
    two answers depending on whether a router stood in front."""
    raw = json.dumps(BODY)
    with live_router([r.base_url for r in two_replicas], policy="round_robin") as (url, _):
        for headers in ({"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}, {}):
            routed = httpx.post(url + "/v1/completions", content=raw, headers=headers, timeout=30)
            direct = httpx.post(two_replicas[0].base_url + "/v1/completions", content=raw, headers=headers,
                                timeout=30)
            assert routed.status_code == direct.status_code == 415, (headers, routed.text)
            assert routed.json()["error"]["message"] == direct.json()["error"]["message"]
        for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
            assert httpx.post(url + "/v1/completions", content=raw, headers={"content-type": ctype},
                              timeout=30).status_code == 200, ctype
