"""The result cache on the real bundled model: a greedy hit equals a fresh run but for id and created."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from loom.router.result_cache import ResultCache

pytestmark = pytest.mark.slow

_ID_CREATED = re.compile(rb'"id": ?"(chatcmpl|cmpl)-[0-9a-f]{32}"|"created": ?\d+')


def test_greedy_hit_equals_a_fresh_run_on_the_bundled_model() -> None:
    from loom.config import EngineArgs
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.server.api_server import build_app

    front = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=256, max_num_seqs=4))
    try:
        app = build_app(front, result_cache=ResultCache(max_entries=16))
        digest = front.model_identity.digest

        async def run() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                card = (await c.get("/v1/models")).json()["data"][0]
                assert card["loom_model_identity"]["digest"] == digest
                for route, body in (
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                                                  "temperature": 0, "max_tokens": 8, "logprobs": True}),
                        ("/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8,
                                             "stream": True})):
                    await c.post(route, json=body, headers={"cache-control": "no-store"})  # warms the prefix cache
                    runs = [await c.post(route, json=body, headers=h)
                            for h in ({}, {}, {"cache-control": "no-cache"})]
                    assert [r.headers["x-loom-result-cache"] for r in runs] == ["miss", "hit", "bypass"]
                    assert all(r.status_code == 200 for r in runs)
                    stored, hit, fresh = (_ID_CREATED.sub(b"", r.content) for r in runs)
                    assert hit == fresh == stored and runs[1].content != runs[0].content

        asyncio.run(run())
    finally:
        front.shutdown()
