"""Sliding-window attention: blocks wholly outside the window are released early, outputs unchanged."""

from __future__ import annotations

from pathlib import Path

from loom.core.kv_cache_manager import KVCacheManager
from tests.core.conftest import make_request, reference_output
from tests.kv.conftest import OffloadFakeRunner, run_with_checks
from tests.kv.test_host_tier import make_sched


def test_blocks_outside_the_window_are_freed_early_and_shared_prefixes_stay_correct() -> None:
    window, bs = 6, 4
    sched = make_sched(16, sliding_window=window, max_num_batched_tokens=5)
    runner = OffloadFakeRunner(bs)
    manager = sched.kv_cache_manager
    most_live = 0

    def watch(_: int) -> None:
        nonlocal most_live
        for blocks in manager.req_to_blocks.values():
            most_live = max(most_live, sum(b is not None for b in blocks))

    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt, 30))
    tokens = run_with_checks(sched, runner, watch)
    assert tokens["a"] == reference_output(prompt, 30)
    # A query sees `window` keys; with this step's chunk (<= 5 tokens) that spans at most 4 blocks.
    assert most_live <= 4 < 40 // bs
    assert sched.num_window_blocks_freed >= 40 // bs - 4
    # The freed blocks kept valid K/V and their hashes: a later request with the same prompt may hit them.
    sched.add_request(make_request("b", prompt + [7, 8], 12))
    sched.add_request(make_request("c", prompt, 20))
    tokens = run_with_checks(sched, runner, watch)
    assert tokens["b"] == reference_output(prompt + [7, 8], 12)
    assert tokens["c"] == reference_output(prompt, 20)
    assert sched.prefix_cache_hits > 0
    assert sched.num_free_blocks == 16


def test_swap_preemption_with_released_window_blocks_falls_back_to_recompute() -> None:
    sched = make_sched(7, num_host_blocks=32, preemption_mode="swap", sliding_window=5, max_num_batched_tokens=6)
    runner = OffloadFakeRunner(4)
    prompts = {f"r{i}": [i] + list(range(20 * i, 20 * i + 6)) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, 16))
    tokens = run_with_checks(sched, runner)
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_output(prompt, 16), rid
    assert sched.num_preemptions_total > 0 and sched.num_free_blocks == 7
    # A request whose window already released blocks cannot be swapped back whole: it is recomputed.
    manager = KVCacheManager(16, 4, True, num_host_blocks=16, sliding_window=5)
    request = make_request("long", range(20), 4)
    assert manager.allocate_slots(request, 20) is not None
    request.num_computed_tokens = 20
    assert manager.allocate_slots(request, 1) is not None  # queries from position 20 on: blocks 0-3 are dead
    assert manager.num_window_blocks_freed == 4
    assert manager.preempt(request, swap=True) is False
    assert manager.offload_counters.num_blocks_recomputed == 5 and manager.num_free_blocks == 16


def _save_tiny_mistral(directory: Path, hf_tokenizer, sliding_window: int) -> Path:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from tests.model.model_harness import randomize_

    config = MistralConfig(
        vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=sliding_window,
        bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    model = MistralForCausalLM(config)
    randomize_(model, seed=3)
    model.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer.save_pretrained(directory)
    return directory


def test_tiny_mistral_with_window_matches_transformers_and_frees_blocks(tmp_path: Path, hf_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from loom import LLM, SamplingParams
    from tests.helpers import hf_greedy

    directory = _save_tiny_mistral(tmp_path / "mistral", hf_tokenizer, sliding_window=8)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [hf_tokenizer.encode(p) for p in ("The quick brown fox jumps over the lazy dog.", "1, 2, 3, 4,")]
    reference = [hf_greedy(hf, ids, 24)[0] for ids in prompts]
    llm = LLM(model=str(directory), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert llm.engine.scheduler.num_window_blocks_freed > 0
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.num_free_blocks == 64


def test_prefix_hit_needs_only_the_last_window_of_blocks() -> None:
    """One window for every layer (Mistral): after the first blocks of a cached prefix were evicted, a request with
    that prefix still hits it whole, since its first query sees only the last window; its output is unchanged."""
    window, bs = 6, 4
    sched = make_sched(32, sliding_window=window, max_num_batched_tokens=8)
    runner = OffloadFakeRunner(bs)
    manager = sched.kv_cache_manager
    prompt = list(range(100, 124))
    sched.add_request(make_request("a", prompt, 4))
    run_with_checks(sched, runner)
    probe = make_request("probe", prompt + [1, 2], 1)
    manager.update_block_hashes(probe)
    for block_hash in probe.block_hashes[:3]:
        manager.block_pool._evict(manager.block_pool.cached_block_hash_to_block[block_hash])
    blocks, hit = manager.get_computed_blocks(probe)
    # a query at 24 sees 19..24: blocks 4 and 5 (positions 16-23) are all it needs
    assert hit == 24 and blocks[:4] == [None] * 4 and None not in blocks[4:]
    hits_before = sched.prefix_cache_hits
    sched.add_request(make_request("b", prompt + [1, 2], 12))
    tokens = run_with_checks(sched, runner)
    assert tokens["b"] == reference_output(prompt + [1, 2], 12)
    assert sched.prefix_cache_hits - hits_before == 24
    assert sched.num_free_blocks == 32
    # without a window the same evictions leave no hit at all
    full = KVCacheManager(32, bs, True)
    first = make_request("a", prompt, 1)
    assert full.allocate_slots(first, 24) is not None
    first.num_computed_tokens = 24
    full.free(first)
    full.update_block_hashes(probe)
    full.block_pool._evict(full.block_pool.cached_block_hash_to_block[probe.block_hashes[0]])
    assert full.get_computed_blocks(probe)[1] == 0
