"""The router with prefill replicas (prefill/decode disaggregation): answers equal a co-located replica's,
streamed or not, the decode replica really pulled the blocks, and a dead prefill replica costs nothing but time."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import save_tiny_model
from tests.router.conftest import live_router
from tests.server.conftest import serve_disagg_trio

PROMPT = "A router sends the prompt to one replica and the decoding to another, and the answer is"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer):
    model = str(save_tiny_model(tmp_path_factory.mktemp("router_disagg") / "llama", "llama", hf_tokenizer))

    with serve_disagg_trio(model) as trio:
        yield trio


def _streamed_text(raw: str) -> str:
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_disaggregated_through_the_router_equals_colocated(servers) -> None:
    p, d, c = servers
    body = {"model": c.app.state.ctx.model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    want = httpx.post(c.v1 + "/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with live_router([d.base_url], prefill_urls=[p.base_url], health_interval_s=60) as (url, _):
        plain = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == want
        assert plain.headers["x-loom-prefill-replica"] == p.base_url and plain.headers["x-loom-replica"] == d.base_url
        streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        assert _streamed_text(streamed.text) == want
        roles = {r["url"]: r["role"] for r in httpx.get(url + "/router/replicas").json()["replicas"]}
        assert roles == {p.base_url: "prefill", d.base_url: "decode"}
    stats = d.engine.get_stats()
    assert stats.kv_transfer_pulls >= 2 and stats.kv_transfer_pull_failures == 0
    metrics = httpx.get(d.base_url + "/metrics", timeout=10).text
    pulls = [line for line in metrics.splitlines() if line.startswith("loom:kv_transfer_pulls_total{")]
    assert pulls and float(pulls[0].split()[-1]) >= 2  # exported, not only in EngineStats
    # a prefill replica that is not a producer (a plain replica): not used, the decode replica computes
    with live_router([d.base_url], prefill_urls=[c.base_url], health_interval_s=60) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert "x-loom-prefill-replica" not in r.headers
    # a prefill replica that is gone: the decode replica computes the prompt, same answer
    with live_router([d.base_url], prefill_urls=["http://127.0.0.1:9"], health_interval_s=60) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert "x-loom-prefill-replica" not in r.headers  # unhealthy: not used


def test_prefill_replicas_are_administered_like_the_others(servers) -> None:
    p, d, c = servers
    body = {"model": c.app.state.ctx.model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with live_router([d.base_url], health_interval_s=60) as (url, _):
        assert "x-loom-prefill-replica" not in httpx.post(url + "/v1/completions", json=body, timeout=60).headers
        added = httpx.post(url + "/router/add", json={"url": p.base_url, "role": "prefill"}, timeout=30)
        assert added.status_code == 200 and added.json()["healthy"], added.text
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.headers.get("x-loom-prefill-replica") == p.base_url
        assert httpx.post(url + "/router/drain", json={"url": p.base_url}, timeout=10).json()["draining"]
        assert "x-loom-prefill-replica" not in httpx.post(url + "/v1/completions", json=body, timeout=60).headers
        assert httpx.post(url + "/router/remove", json={"url": p.base_url}, timeout=10).status_code == 200
        assert [r["role"] for r in httpx.get(url + "/router/replicas").json()["replicas"]] == ["serve"]
        bad = httpx.post(url + "/router/add", json={"url": p.base_url, "role": "king"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
        extra = httpx.post(url + "/router/add", json={"url": p.base_url, "weight": 2}, timeout=10)
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "url"
