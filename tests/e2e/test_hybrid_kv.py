"""The hybrid KV cache end to end on a tiny Gemma 3 (a sliding layer with a window of 8 tokens, a global layer):
greedy output equals transformers' and the one-table cache's, while the sliding layer's blocks outside its
window go back to the pool; with prefix caching, chunked prefill and preemption; dense and packed (the one-call
C decode step reading each layer's own block table)."""

from __future__ import annotations

import pytest

from loom import LLM, SamplingParams
from tests.helpers import hf_greedy, run_engine_checked, save_tiny_model

NEW = 24


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, hf_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", "gemma3", hf_tokenizer)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    shared = hf_tokenizer.encode("You are a helpful assistant. Answer briefly and well, and think first.")[:16]
    texts = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):", "1, 2, 3, 4, 5,",
             "Once upon a time, in a land far away, there lived a king who"]
    return [shared + hf_tokenizer.encode(t) for t in texts]


def _engine(model: str, hybrid: bool, **kw):
    return LLM(model=model, dtype="float32", block_size=4, hybrid_kv_cache=hybrid, **kw).engine


@pytest.mark.parametrize("quantization", ["none", "w8a16"])
def test_hybrid_kv_cache_matches_one_table_and_frees_the_window(gemma_dir, prompts, quantization: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    model = str(gemma_dir)
    runs = {}
    for hybrid in (True, False):
        engine = _engine(model, hybrid, quantization=quantization, num_kv_blocks=64, max_num_batched_tokens=12)
        runs[hybrid] = (run_engine_checked(engine, prompts, params), engine)
    (out_hybrid, hybrid_engine), (out_plain, plain_engine) = runs[True], runs[False]
    assert out_hybrid == out_plain  # a feature on vs off does not change greedy output
    if quantization == "none":
        hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
        assert out_hybrid == [hf_greedy(hf, ids, NEW)[0] for ids in prompts]
    elif hybrid_engine.runner.device.type == "cpu":  # the packed model decodes in the one-call C step, each
        # layer through its own group's table (a CPU kernel: a GPU runs the layers in torch)
        assert hybrid_engine.runner.model.model.decode_step is not None
    assert len(hybrid_engine.runner.kv_groups) == 2 and len(plain_engine.runner.kv_groups) == 1
    assert hybrid_engine.scheduler.num_window_blocks_freed > 0 and plain_engine.scheduler.num_window_blocks_freed == 0
    assert hybrid_engine.get_stats().prefix_cache_hits > 0  # the shared 16-token prefix


def test_a_long_request_holds_fewer_blocks_and_survives_preemption(gemma_dir, prompts) -> None:
    """One block holds one layer's rows in the hybrid cache (a page per group) and both layers' in the plain one;
    a 40 + 40 token request at its end holds 20 + 3 pages against 20 blocks of twice the size; with too few
    blocks for all four prompts at once, preemption recomputes and the output is unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long_prompt = (prompts[3] * 3)[:40]
    engine = _engine(str(gemma_dir), True, num_kv_blocks=200)
    engine.add_request("long", long_prompt, params)
    held = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        held = max(held, engine.num_kv_blocks - engine.scheduler.num_free_blocks)
    assert held <= 20 + 4  # the global layer's 20 blocks and the sliding layer's window (8 tokens, 2-3 blocks)
    tight = _engine(str(gemma_dir), True, num_kv_blocks=40, max_num_batched_tokens=16)
    roomy = _engine(str(gemma_dir), True, num_kv_blocks=400)
    short = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert run_engine_checked(tight, prompts, short) == run_engine_checked(roomy, prompts, short)
    assert tight.get_stats().num_preemptions > 0


def test_prefix_hit_past_evicted_blocks_outside_the_window(gemma_dir, prompts, hf_tokenizer) -> None:
    """A 40-token prefix computed once, whose sliding-layer blocks 0-6 were then evicted: a second request with
    that prefix still hits all 40 tokens (its sliding layer needs only the last window's blocks, vLLM's rule), and
    its greedy output equals transformers' and an engine's without prefix caching."""
    import torch
    from transformers import AutoModelForCausalLM

    from loom.core.kv_cache_manager import hash_block_tokens

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prefix = (prompts[3] * 3)[:40]
    second = prefix + hf_tokenizer.encode(" And then the dragon said")
    engine = _engine(str(gemma_dir), True, num_kv_blocks=200)
    run_engine_checked(engine, [prefix], params)
    manager = engine.scheduler.kv_cache_manager
    pool, sliding = manager.block_pool, manager.groups[1]
    parent = None
    for i in range(7):
        parent = hash_block_tokens(parent, tuple(prefix[4 * i : 4 * i + 4]), ())
        pool._evict(pool.cached_block_hash_to_block[sliding._key(parent)])
    hits_before = engine.get_stats().prefix_cache_hits
    out = run_engine_checked(engine, [second], params)
    assert engine.get_stats().prefix_cache_hits - hits_before == 40
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    assert out == [hf_greedy(hf, second, NEW)[0]]
    no_cache = _engine(str(gemma_dir), True, num_kv_blocks=200, enable_prefix_caching=False)
    assert out == run_engine_checked(no_cache, [second], params)
