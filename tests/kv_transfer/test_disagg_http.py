"""Two live `loom serve` apps (tiny random Llama, float32), prefill on one and decode on the other through the
router's helper: the answers equal a co-located replica's, streamed or not, and both replicas end with every
block free. Errors name kv_transfer_params."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loom.router.disagg import prefill_body, prefill_then_decode
from tests.helpers import save_tiny_model
from tests.server.conftest import serve_disagg_trio

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest where"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer):
    model = str(save_tiny_model(tmp_path_factory.mktemp("disagg_http") / "llama", "llama", hf_tokenizer))

    with serve_disagg_trio(model) as trio:
        yield trio


def _text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["text"]


async def _disagg(p: str, d: str, body: dict) -> tuple[int, str]:
    async with httpx.AsyncClient(timeout=60) as client:
        r, _ = await prefill_then_decode(client, p, d, "/v1/completions", body, {"x-test": "1"})
        try:
            raw = (await r.aread()).decode()
        finally:
            await r.aclose()
    if not body.get("stream"):
        return r.status_code, json.loads(raw)["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]
    return r.status_code, "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_disaggregated_answers_equal_colocated(servers) -> None:
    p, d, c = servers
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    want = _text(httpx.post(c.v1 + "/completions", json=body, timeout=60))
    assert asyncio.run(_disagg(p.base_url, d.base_url, body)) == (200, want)
    assert asyncio.run(_disagg(p.base_url, d.base_url, {**body, "stream": True})) == (200, want)
    stats = d.engine.get_stats()
    assert stats.kv_transfer_pulls == 2 and stats.kv_transfer_blocks_loaded > 0 and stats.kv_transfer_pull_failures == 0
    # the prefill replica answered with where its blocks are
    r = httpx.post(p.v1 + "/completions", json=prefill_body(body), timeout=60)
    kvp = r.json()["kv_transfer_params"]
    assert kvp["do_remote_prefill"] and kvp["remote_port"] > 0 and len(r.json()["choices"][0]["text"]) > 0
    httpx.post(d.v1 + "/completions", json={**body, "kv_transfer_params": kvp}, timeout=60)
    for live in (p, d):  # every block back in the pool once pulled (the idle loop frees pulled transfers)
        checked = asyncio.run(live.engine.call(lambda e: (e.on_idle(), e.scheduler.check_invariants(),
                                                          e.get_stats().num_free_blocks)))
        assert checked[2] == 96


def test_prefill_replica_gone_decode_computes(servers) -> None:
    _, d, c = servers
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = _text(httpx.post(c.v1 + "/completions", json=body, timeout=60))
    assert asyncio.run(_disagg("http://127.0.0.1:9", d.base_url, body)) == (200, want)


@pytest.mark.parametrize("kvp,message", [
    ("yes", "valid dictionary"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "exactly one"),
    ({"do_remote_prefill": True, "remote_host": "h"}, "kv_transfer_params."),
])
def test_bad_field_is_a_400_naming_it(servers, kvp, message: str) -> None:
    _, d, _ = servers
    r = httpx.post(d.v1 + "/completions", json={"prompt": "hi", "kv_transfer_params": kvp}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert message in r.json()["error"]["message"]


def test_role_the_replica_does_not_play_is_a_400(servers) -> None:
    _, d, c = servers
    r = httpx.post(d.v1 + "/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    r = httpx.post(c.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text


def test_a_consumer_pulls_only_from_its_allowed_peers(servers) -> None:
    """kv_transfer_params name the host to pull from: a client must not make the replica connect anywhere (or
    load K/V that it did not compute) — only the hosts of --kv-transfer-peers (loopback by default)."""
    p, d, _ = servers
    kvp = httpx.post(p.v1 + "/completions", json=prefill_body({"prompt": PROMPT, "max_tokens": 4}),
                     timeout=60).json()["kv_transfer_params"]
    r = httpx.post(d.v1 + "/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                               "kv_transfer_params": {**kvp, "remote_host": "169.254.169.254"}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert "--kv-transfer-peers" in r.json()["error"]["message"]
    httpx.post(d.v1 + "/completions", json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kvp},
               timeout=60)  # the real one: pulled, so the producer's pinned blocks are freed
