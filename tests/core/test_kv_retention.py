"""KV retention policies (loom/core/kv_retention.py): the policies' choices, the compacted block table, and the
engine against a Hugging Face reference that masks exactly the dropped positions."""

from __future__ import annotations

import random

import pytest
import torch

from loom.config import EngineArgs
from loom.core.kv_retention import (KVRetentionConfig, RetentionState, check_budget, get_retention_policy)
from loom.engine.llm_engine import LLMEngine
from loom.sampling_params import SamplingParams
from tests.helpers import run_engine_checked, save_tiny_model

BS = 16


def _state(policy: str, num_blocks: int, budget: float, window: int = 16, sink_tokens: int = 4,
           scores: list[float] | None = None) -> RetentionState:
    config = KVRetentionConfig(policy, budget, sink_tokens, window)
    return RetentionState(config, list(range(num_blocks)), scores or [0.0] * num_blocks,
                          budget_tokens=config.budget_tokens(num_blocks * BS))


# ---- the policies alone --------------------------------------------------------------------------------------


def test_budget_fraction_and_tokens() -> None:
    assert KVRetentionConfig("sinks", 0.25).budget_tokens(1000) == 250
    assert KVRetentionConfig("sinks", 1).budget_tokens(1000) == 1000
    assert KVRetentionConfig("sinks", 300).budget_tokens(1000) == 300
    for bad in (0, -1, 2.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="kv_retention_budget"):
            check_budget(bad)
    with pytest.raises(ValueError, match="kv_retention must be one of"):
        KVRetentionConfig("lru")
    with pytest.raises(ValueError, match="kv_retention_window"):
        KVRetentionConfig("sinks", window=0)


def test_sinks_keep_first_block_and_recent_window() -> None:
    state = _state("sinks", 16, 0.25)  # 256 tokens -> 64 kept: 4 blocks
    drops = get_retention_policy("sinks").select_drops(state, 16 * BS, BS, prompt_done=True)
    kept = [i for i in range(16) if i not in drops]
    # block 0 (the sinks) and the newest 1 + window / BS = 2 blocks are protected; the oldest others go first
    assert kept == [0, 13, 14, 15]


def test_nothing_is_cut_before_the_prompt_is_done_or_within_budget() -> None:
    for name in ("sinks", "h2o", "snapkv"):
        policy = get_retention_policy(name)
        assert policy.select_drops(_state(name, 16, 0.25), 16 * BS, BS, prompt_done=False) == []
        assert policy.select_drops(_state(name, 16, 1.0), 16 * BS, BS, prompt_done=True) == []


def test_h2o_drops_the_least_attended_blocks() -> None:
    scores = [9.0, 1.0, 5.0, 0.5, 7.0, 0.1, 3.0, 2.0, 8.0, 8.0]
    state = _state("h2o", 10, 0.5, window=16, scores=scores)  # 160 tokens -> 80 kept: 5 blocks
    drops = get_retention_policy("h2o").select_drops(state, 10 * BS, BS, prompt_done=True)
    # protected: block 0 (sinks) and blocks 8, 9 (newest + window); of 1..7 the two best (4: 7.0, 2: 5.0) stay
    assert drops == [1, 3, 5, 6, 7]


def test_snapkv_pools_neighbouring_scores_and_cuts_once() -> None:
    scores = [0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    state = _state("snapkv", 12, 0.5, window=16, scores=scores)  # 6 blocks kept
    policy = get_retention_policy("snapkv")
    assert policy.score_rows(state, 0, 192, 192) == 16  # the last 16 known tokens, in one chunk
    assert policy.score_rows(state, 0, 100, 192) == 0  # a chunk before the window
    assert policy.score_rows(state, 100, 184, 192) == 8  # a chunk holding the window's first 8 rows
    assert policy.score_rows(state, 184, 192, 192) == 8  # and the one holding the rest
    drops = policy.select_drops(state, 12 * BS, BS, prompt_done=True)
    kept = [i for i in range(12) if i not in drops]
    assert kept == [0, 3, 4, 5, 10, 11]  # the hot block 4 with its pooled neighbours 3 and 5
    assert state.cut_prompt and policy.score_rows(state, 192, 193, 193) == 0


# ---- the engine: compaction against a masked Hugging Face reference --------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, hf_tokenizer) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("retention") / "llama", "llama", hf_tokenizer, seed=3))


def _engine(model: str, **kw) -> LLMEngine:
    args = dict(model=model, dtype="float32", num_kv_blocks=96, block_size=BS, max_num_batched_tokens=512,
                kv_retention_window=16, kv_retention_sink_tokens=4)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _record_drops(engine: LLMEngine) -> list[tuple[str, int, list[int]]]:
    """(request id, computed tokens when cut, positions dropped) of every drop the scheduler makes."""
    log: list[tuple[str, int, list[int]]] = []
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    original = manager.drop_blocks

    def spy(request_id, indices):  # noqa: ANN001, ANN202
        positions = scheduler._retention[request_id].block_positions  # still the table before the drop
        log.append((request_id, scheduler.requests[request_id].num_computed_tokens, [positions[i] for i in indices]))
        original(request_id, indices)

    manager.drop_blocks = spy
    return log


@torch.inference_mode()
def _hf_masked_greedy(model_dir: str, prompt: list[int], output: list[int],
                      drops: list[tuple[int, list[int]]]) -> list[int]:
    """Greedy tokens of the Hugging Face model over prompt + output when each query at position p sees the keys at
    positions <= p except the blocks dropped before p was computed (drops: (computed tokens when cut, blocks))."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    ids = prompt + output[:-1]
    n = len(ids)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for computed, blocks in drops:
        for b in blocks:
            allowed[computed:, b * BS : (b + 1) * BS] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    logits = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0]
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("policy,chunk", [("sinks", 512), ("h2o", 512), ("snapkv", 512), ("sinks", 199),
                                          ("h2o", 64), ("snapkv", 190)])
def test_engine_matches_masked_reference(tiny_llama: str, policy: str, chunk: int) -> None:
    """The compacted table (slots, context lengths, original positions) attends exactly over the kept blocks:
    greedy tokens equal a dense reference whose mask hides the dropped blocks, float32; with a chunked prefill
    (a chunk ending one token before the prompt's end included) the cut still follows the whole prompt."""
    rng = random.Random(7)
    prompt = [rng.randrange(10, 4000) for _ in range(200)]
    engine = _engine(tiny_llama, kv_retention=policy, kv_retention_budget=64, max_num_batched_tokens=chunk)
    log = _record_drops(engine)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (output,) = run_engine_checked(engine, [prompt], params)
    assert log, "the policy cut nothing"
    assert log[0][1] == len(prompt)  # the first cut follows the exact prefill
    reference = _hf_masked_greedy(tiny_llama, prompt, output, [(c, b) for _, c, b in log])
    assert output == reference
    stats = engine.scheduler.kv_cache_manager
    assert stats.num_retention_blocks_freed == sum(len(b) for _, _, b in log)


def test_full_retention_and_a_budget_above_the_context_change_nothing(tiny_llama: str) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in (90, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_engine_checked(_engine(tiny_llama), prompts, params)
    assert run_engine_checked(_engine(tiny_llama, kv_retention="full"), prompts, params) == plain
    assert run_engine_checked(_engine(tiny_llama, kv_retention="h2o", kv_retention_budget=1.0), prompts,
                              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                             kv_retention_budget=1000)) == plain


@torch.inference_mode()
def _reference_block_scores(model_dir: str, prompt: list[int], rows: list[int], reduce: str) -> torch.Tensor:
    """Attention each block of the prompt receives from query rows `rows` (summed), per layer and head, then summed
    (reduce "sum") or maxed ("max") over layers and heads (Hugging Face eager attention weights)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    out = model(input_ids=torch.tensor([prompt]), output_attentions=True)
    weights = torch.stack(out.attentions)[:, 0]  # [layers, heads, q, k]
    per_key = weights[:, :, rows].sum(dim=2)  # [layers, heads, k]
    nb = -(-len(prompt) // BS)
    per_block = torch.nn.functional.pad(per_key, (0, nb * BS - len(prompt))).view(*per_key.shape[:2], nb, BS).sum(3)
    return per_block.sum(dim=(0, 1)) if reduce == "sum" else per_block.amax(dim=(0, 1))


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_kept_set_matches_reference_from_attention_weights(tiny_llama: str, policy: str) -> None:
    """The first cut keeps what the policy computes from the true attention weights of the prompt (H2O: the sampled
    rows of the prefill; SnapKV: the observation window), with the same protections."""
    from loom.attention.kv_scores import ROW_STRIDE

    rng = random.Random(9)
    n = 230
    prompt = [rng.randrange(10, 4000) for _ in range(n)]
    engine = _engine(tiny_llama, kv_retention=policy, kv_retention_budget=80, enable_prefix_caching=False)
    log = _record_drops(engine)
    run_engine_checked(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    # max_tokens=1 ends the request before any cut: run with 2 so that the cut after the prefill happens
    if not log:
        engine = _engine(tiny_llama, kv_retention=policy, kv_retention_budget=80, enable_prefix_caching=False)
        log = _record_drops(engine)
        run_engine_checked(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    rows = list(range(n - 1, -1, -ROW_STRIDE))[::-1] if policy == "h2o" else list(range(n - 16, n))
    scores = _reference_block_scores(tiny_llama, prompt, rows, get_retention_policy(policy).score_reduce).tolist()
    state = _state(policy, len(scores), 80, window=16, scores=scores)
    expected = get_retention_policy(policy).select_drops(state, n, BS, prompt_done=True)
    assert log[0][2] == expected


def test_lossy_request_never_feeds_the_prefix_cache_after_a_cut(tiny_llama: str) -> None:
    """Blocks computed after a cut depend on the dropped state: the prefix cache holds only the exact prompt blocks,
    so an identical full-attention request that follows reproduces plain greedy tokens."""
    rng = random.Random(10)
    prompt = [rng.randrange(10, 4000) for _ in range(160)]
    engine = _engine(tiny_llama)
    lossy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, kv_retention="sinks",
                           kv_retention_budget=48)
    (cut,) = run_engine_checked(engine, [prompt], lossy)
    cached_before = len(engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached_before == 160 // BS  # the prompt's full blocks only, none of the output's
    plain = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    # a follow-up whose prompt includes the lossy output: its blocks past the prompt must be computed, not hit
    follow = prompt + cut[:40]
    (again,) = run_engine_checked(engine, [follow], plain)
    (fresh,) = run_engine_checked(_engine(tiny_llama), [follow], plain)
    assert again == fresh


def test_retention_with_preemption_and_prefix_caching_keeps_invariants(tiny_llama: str) -> None:
    """A pool too small for every request at once: preempted lossy requests restart and cut again; every block is
    back at the end and the invariants hold after every step (run_engine_checked)."""
    rng = random.Random(11)
    shared = [rng.randrange(10, 4000) for _ in range(16)]
    prompts = [shared + [rng.randrange(10, 4000) for _ in range(20 + 2 * i)] for i in range(6)]
    # short prompts all fit at once; their outputs outgrow the pool before they outgrow the 64-token budget
    engine = _engine(tiny_llama, num_kv_blocks=12, kv_retention="sinks", kv_retention_budget=64)
    outs = run_engine_checked(engine, prompts, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert all(len(o) == 100 for o in outs)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert engine.scheduler.kv_cache_manager.num_retention_blocks_freed > 0


def test_per_request_policy_and_refused_combinations(tiny_llama: str) -> None:
    engine = _engine(tiny_llama, speculative_method="ngram")
    with pytest.raises(ValueError, match="kv_retention='sinks' with speculative decoding"):
        engine.add_request("x", [1, 2, 3], SamplingParams(kv_retention="sinks"))
    with pytest.raises(ValueError, match="kv_retention_budget has no effect"):
        _engine(tiny_llama).add_request("y", [1, 2, 3], SamplingParams(kv_retention_budget=0.5))
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        EngineArgs(model=tiny_llama, kv_retention="h2o", speculative_method="ngram")
    with pytest.raises(ValueError, match="kv_retention must be one of"):
        SamplingParams(kv_retention="everything")


def test_server_body_and_model_identity_carry_the_setting() -> None:
    from loom.engine.llm_engine import attention_setting
    from loom.server.protocol import CompletionRequest, RequestError, to_sampling_params

    body = CompletionRequest(prompt="x", kv_retention="snapkv", kv_retention_budget=0.5)
    params = to_sampling_params(body, 4, 100, None, None)
    assert (params.kv_retention, params.kv_retention_budget) == ("snapkv", 0.5)
    with pytest.raises(RequestError) as err:
        to_sampling_params(CompletionRequest(prompt="x", kv_retention="most"), 4, 100, None, None)
    assert err.value.param == "kv_retention"
    with pytest.raises(RequestError) as err:
        to_sampling_params(CompletionRequest(prompt="x", kv_retention_budget=-1), 4, 100, None, None)
    assert err.value.param == "kv_retention_budget"
    exact = attention_setting(EngineArgs().cache_config())
    assert exact == "exact"
    assert attention_setting(EngineArgs(kv_retention="sinks").cache_config()) != exact
    assert attention_setting(EngineArgs(sparse_attention="topk-blocks").cache_config()) != exact


def test_dropped_blocks_reach_the_stats_and_prometheus(tiny_llama: str) -> None:
    from loom.server.metrics import ServerMetrics

    rng = random.Random(12)
    engine = _engine(tiny_llama, kv_retention="sinks", kv_retention_budget=32)
    run_engine_checked(engine, [[rng.randrange(10, 4000) for _ in range(120)]],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    stats = engine.get_stats()
    assert stats.kv_retention_blocks_dropped == engine.scheduler.kv_cache_manager.num_retention_blocks_freed > 0
    metrics = ServerMetrics("tiny")
    metrics.on_step([], stats, 0.0)
    assert f"loom:kv_retention_blocks_dropped_total{{model_name=\"tiny\"}} {float(stats.kv_retention_blocks_dropped)}" \
        in metrics.render().decode()


def test_dropping_shared_blocks_leaves_the_other_holder_untouched(tiny_llama: str) -> None:
    """A lossy request and a full one share a long cached prefix: the lossy one's drops only dereference the shared
    blocks, so the full request's tokens equal those it gets alone."""
    rng = random.Random(13)
    shared = [rng.randrange(10, 4000) for _ in range(160)]
    full_prompt = shared + [rng.randrange(10, 4000) for _ in range(9)]
    lossy_prompt = shared + [rng.randrange(10, 4000) for _ in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (alone,) = run_engine_checked(_engine(tiny_llama), [full_prompt], params)
    engine = _engine(tiny_llama)
    engine.add_request("warm", shared + [1], SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("lossy", lossy_prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                             kv_retention="snapkv", kv_retention_budget=48))
    engine.add_request("full", full_prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    assert outputs["full"] == alone
    assert engine.scheduler.kv_cache_manager.num_retention_blocks_freed > 0
    assert engine.scheduler.prefix_cache_hits >= 160 + 144  # both hit the shared blocks (snapkv: all but its window)


def test_snapkv_keeps_its_selection_while_decode_grows() -> None:
    state = _state("snapkv", 12, 0.5, window=16, scores=[0.0, 0, 0, 0, 9.0, 0, 0, 0, 0, 0, 0, 0])
    policy = get_retention_policy("snapkv")
    drops = policy.select_drops(state, 12 * BS, BS, prompt_done=True)
    kept = [p for i, p in enumerate(state.block_positions) if i not in drops]
    state.block_positions, state.scores = kept, [0.0] * len(kept)
    assert kept == [0, 3, 4, 5, 10, 11]
    # decode adds blocks 12, 13, 14: once 12 has left the recent window (13, 14) it goes, the selection stays
    state.block_positions += [12, 13, 14]
    state.scores += [0.0, 0.0, 0.0]
    drops = policy.select_drops(state, 9 * BS, BS, prompt_done=True)
    assert [state.block_positions[i] for i in drops] == [12]


def test_sliding_window_model_is_refused_even_without_the_hybrid_cache(tmp_path, hf_tokenizer) -> None:
    """Gemma 2's local layers mask by position distance: a compacted table would break that, hybrid cache or not."""
    model = str(save_tiny_model(tmp_path / "gemma2", "gemma2", hf_tokenizer))
    for hybrid in (True, False):
        engine = _engine(model, hybrid_kv_cache=hybrid)
        with pytest.raises(ValueError, match="sliding-window"):
            engine.add_request("x", [1, 2, 3], SamplingParams(kv_retention="snapkv"))


def test_h2o_scores_a_strided_sample_of_prompt_rows() -> None:
    """kv_score_rows = -1 scores every ROW_STRIDE-th row of the chunk, ending at its last (not all rows)."""
    from loom.attention.kv_scores import ROW_STRIDE, KVScoreCollector
    from loom.attention.metadata import build_attention_metadata

    torch.manual_seed(0)
    n, heads, kv_heads, dim = 40, 4, 2, 8
    kv_cache = torch.randn(2, 3, BS, kv_heads, dim)
    meta = build_attention_metadata([n], [n], [[0, 1, 2]], BS, torch.device("cpu"))
    query = torch.randn(n, heads, dim)
    sampled, explicit = KVScoreCollector(), KVScoreCollector()
    sampled.add("a", 0, -1)
    sampled.observe(query, kv_cache, meta, 0.3)
    rows = list(range(n - 1, -1, -ROW_STRIDE))[::-1]
    keys = kv_cache[0].reshape(-1, kv_heads, dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.einsum("rhd,shd->rhs", query[rows], keys) * 0.3
    future = torch.arange(n)[None, :] > torch.tensor(rows)[:, None]
    weights = torch.softmax(logits.masked_fill(future[:, None, :], float("-inf")), dim=-1).sum(dim=(0, 1))
    expected = torch.nn.functional.pad(weights, (0, 3 * BS - n)).view(3, BS).sum(1)
    torch.testing.assert_close(sampled.scores["a"], expected, rtol=1e-5, atol=1e-5)
    explicit.add("a", 0, n)
    explicit.observe(query, kv_cache, meta, 0.3)
    assert not torch.allclose(explicit.scores["a"], expected)  # all rows differ from the sample
