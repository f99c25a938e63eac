"""Swap-mode preemption and host-tier prefix hits through the real runner (tiny random Llama, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom import LLM, SamplingParams
from tests.helpers import save_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("swap") / "llama", "llama", hf_tokenizer))


def _prompts(hf_tokenizer) -> list[list[int]]:
    texts = ["The quick brown fox", "def fibonacci(n):", "Bonjour, comment", "1, 2, 3, 4, 5,", "Write a haiku"]
    return [hf_tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_preemption_resumes_identically_through_host_copies(tiny_llama: str, hf_tokenizer, kv_cache_dtype: str) -> None:
    prompts = _prompts(hf_tokenizer)
    roomy = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, PARAMS, use_tqdm=False)]
    tight = LLM(
        model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=7,
        kv_cache_dtype=kv_cache_dtype, kv_offload_memory_gb=0.001, preemption_mode="swap",
    )  # fmt: skip
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == want
    stats = tight.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_restored > 0 and stats.num_blocks_recomputed == 0
    assert stats.num_free_blocks == 14
    tight.engine.scheduler.check_invariants()


def test_prefix_evicted_to_the_host_tier_is_restored_not_recomputed(tiny_llama: str, hf_tokenizer) -> None:
    shared = hf_tokenizer.encode("A long shared system prompt that fills several blocks of four tokens each. " * 2)
    first, second = shared + [11], shared + [12, 13]
    num_blocks = -(-(len(second) + 20) // 4) + 1
    other = hf_tokenizer.encode("Unrelated text " * 60)[: num_blocks * 4 - 24]  # evicts every cached block
    roomy = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    want = roomy.generate([second], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=num_blocks, kv_offload_memory_gb=0.001)
    for prompt in (first, other):
        llm.generate([prompt], PARAMS, use_tqdm=False)
    hits_before = llm.engine.get_stats().prefix_cache_hits
    got = llm.generate([second], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.engine.get_stats()
    assert got == want
    assert stats.num_blocks_offloaded > 0 and stats.num_blocks_restored >= len(shared) // 4 - 1
    assert stats.prefix_cache_hits - hits_before >= (len(shared) // 4) * 4
