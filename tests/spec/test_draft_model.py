"""The draft-model proposer: its drafts are the draft model's own greedy continuation, its KV cache follows
acceptance and rollback, its pool evicts, and the engine's output does not change (tiny random models with
the SmolLM2 tokenizer, and the bundled model drafting for itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom import LLM, SamplingParams
from loom.config import CacheConfig, ModelConfig
from loom.spec import DraftRequest
from loom.spec.draft_model import DraftModelProposer
from loom.worker.model_runner import ModelRunner
from tests.helpers import run_engine_checked, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    return {
        "target": save_tiny_model(root / "target", "llama", hf_tokenizer, seed=0),
        "other": save_tiny_model(root / "other", "llama", hf_tokenizer, seed=1, num_hidden_layers=1),
        "bad_vocab": save_tiny_model(root / "bad_vocab", "llama", hf_tokenizer, seed=2,
                                     vocab_size=len(hf_tokenizer) + 8),
    }


def _runner(path: Path, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    return ModelRunner(ModelConfig(model=str(path), dtype="float32"),
                       CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
                       torch.device("cpu"))


def _greedy(path: Path, tokens: list[int], n: int) -> list[int]:
    llm = LLM(model=str(path), dtype="float32")
    return llm.generate([list(tokens)], SamplingParams(temperature=0.0, max_tokens=n,
                                                       ignore_eos=True))[0].outputs[0].token_ids


PROMPT = [1, 400, 1200, 77, 3001, 18, 9, 4400, 250]


def test_drafts_are_the_draft_models_greedy_continuation(tiny_dirs: dict[str, Path]) -> None:
    proposer = DraftModelProposer(_runner(tiny_dirs["other"]), max_model_len=512)
    expected = _greedy(tiny_dirs["other"], PROMPT, 6)
    assert proposer.propose("a", PROMPT, 4) == expected[:4]
    assert proposer.num_forward_passes == 4  # one catch-up pass, then one per further draft
    # the target kept two drafts and then chose a different token: the cache keeps PROMPT + 2 drafts
    other = (expected[2] + 1) % 49152
    grown = PROMPT + expected[:2] + [other]
    fresh = DraftModelProposer(_runner(tiny_dirs["other"]), max_model_len=512)
    drafts = proposer.propose("a", grown, 3)
    assert drafts == fresh.propose("a", grown, 3) == _greedy(tiny_dirs["other"], grown, 3)
    assert proposer._states["a"].tokens == grown + drafts[:2]  # K/V held: the tokens and all drafts but the last
    # every draft accepted plus the bonus: the cache already holds all of them but the last two
    kept = grown + drafts + [17]
    assert proposer.propose("a", kept, 2) == _greedy(tiny_dirs["other"], kept, 2)
    total = proposer.runner.num_blocks
    proposer.request_finished("a", [])
    assert proposer.num_free_blocks == total
    proposer.request_finished("a", [])  # twice: ignored
    assert proposer.num_free_blocks == total


def test_batched_drafting_equals_one_at_a_time(tiny_dirs: dict[str, Path]) -> None:
    asks = [DraftRequest("a", PROMPT, 4), DraftRequest("b", PROMPT[:5], 2), DraftRequest("c", PROMPT[3:] * 2, 3)]
    batched = DraftModelProposer(_runner(tiny_dirs["other"]), max_model_len=512)
    got = batched.propose_batch(asks)
    assert batched.num_forward_passes == 4  # the longest request's drafts, for all three at once
    alone = [DraftModelProposer(_runner(tiny_dirs["other"]), max_model_len=512).propose(
        a.request_id, a.token_ids, a.max_tokens) for a in asks]
    assert got == alone
    assert [len(d) for d in got] == [4, 2, 3]


def test_a_long_catch_up_is_spread_over_steps(tiny_dirs: dict[str, Path]) -> None:
    proposer = DraftModelProposer(_runner(tiny_dirs["other"]), max_model_len=512, max_catch_up_tokens=4)
    expected = _greedy(tiny_dirs["other"], PROMPT, 3)
    assert proposer.propose("a", PROMPT, 3) == []  # 4 of 9 tokens cached
    assert proposer.propose("a", PROMPT, 3) == []  # 8 of 9
    assert proposer.propose("a", PROMPT, 3) == expected  # the last token, then drafts
    assert proposer.num_forward_passes == 2 + 3
    # the budget is per step, shared: b's first chunk fits beside a's one-token catch-up
    got = proposer.propose_batch([DraftRequest("a", PROMPT + expected, 2), DraftRequest("b", PROMPT, 2)])
    assert got[0] == _greedy(tiny_dirs["other"], PROMPT + expected, 2) and got[1] == []
    assert proposer._states["b"].tokens == PROMPT[:3]


def test_a_dry_pool_evicts_the_least_recent_and_never_a_request_of_this_step(tiny_dirs: dict[str, Path]) -> None:
    proposer = DraftModelProposer(_runner(tiny_dirs["other"], num_blocks=6, block_size=4), max_model_len=512)
    asks = [DraftRequest(rid, PROMPT[:8], 4) for rid in "abc"]  # each needs ceil((8 + 3) / 4) = 3 blocks
    drafts = proposer.propose_batch(asks)
    expected = _greedy(tiny_dirs["other"], PROMPT[:8], 4)
    assert drafts == [expected, expected, []]  # c does not fit beside a and b
    assert proposer.propose("c", PROMPT[:8], 4) == expected  # now a (least recent) gives way
    assert "a" not in proposer._states and {"b", "c"} <= proposer._states.keys()
    assert proposer.propose("a", PROMPT[:8], 4) == expected  # recomputed from scratch
    for rid in "abc":
        proposer.request_finished(rid, [])
    assert proposer.num_free_blocks == 6


def test_engine_output_is_unchanged_and_a_self_draft_is_always_kept(tiny_dirs: dict[str, Path], hf_tokenizer) -> None:
    prompts = [hf_tokenizer.encode(t) for t in ("one two three four", "def f(x):\n    return", "The end")]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(tiny_dirs["target"]), dtype="float32")
    expected = run_engine_checked(plain.engine, prompts, params)
    for draft, all_kept in ((tiny_dirs["target"], True), (tiny_dirs["other"], False)):
        llm = LLM(model=str(tiny_dirs["target"]), dtype="float32", speculative_method="draft_model",
                  speculative_model=str(draft), num_speculative_tokens=4, speculative_disable_by_batch_size=None,
                  block_size=4, num_kv_blocks=24, max_num_batched_tokens=12)  # preemption and chunked prefill
        assert run_engine_checked(llm.engine, prompts, params) == expected
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0
        if all_kept:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens
        proposer = llm.engine.scheduler.proposer
        assert proposer.num_free_blocks == proposer.runner.num_blocks  # every draft block back


def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_dirs: dict[str, Path], hf_tokenizer) -> None:
    prompts = [hf_tokenizer.encode("one two three four one two")]
    params = SamplingParams(temperature=0.7, top_k=2, seed=11, max_tokens=16, ignore_eos=True)  # argmax >= 1/2
    plain = LLM(model=str(tiny_dirs["target"]), dtype="float32").generate(prompts, params)
    drafted = LLM(model=str(tiny_dirs["target"]), dtype="float32", speculative_method="draft_model",
                  speculative_model=str(tiny_dirs["target"]), speculative_disable_by_batch_size=None)
    assert drafted.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert drafted.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_bad_draft_settings_are_refused(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(model=str(tiny_dirs["target"]), speculative_method="draft_model")
    with pytest.raises(ValueError, match="only used by speculative_method 'draft_model'"):
        LLM(model=str(tiny_dirs["target"]), speculative_method="ngram", speculative_model=str(tiny_dirs["other"]))
    with pytest.raises(ValueError, match="speculative_quantization is only used"):
        LLM(model=str(tiny_dirs["target"]), speculative_method="suffix", speculative_quantization="w8a16")
    with pytest.raises(ValueError, match="speculative_model path '/nonexistent/draft.gguf' does not exist"):
        LLM(model=str(tiny_dirs["target"]), speculative_method="draft_model", speculative_model="/nonexistent/draft.gguf")
    readme = Path(__file__).resolve().parents[2] / "README.md"
    with pytest.raises(ValueError, match=r"speculative_model \(the draft\): .*not a GGUF file"):
        LLM(model=str(tiny_dirs["target"]), speculative_method="draft_model", speculative_model=str(readme))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=str(tiny_dirs["target"]), dtype="float32", speculative_method="draft_model",
            speculative_model=str(tiny_dirs["bad_vocab"]))


def test_the_bundled_model_drafting_for_itself_keeps_its_greedy_output(hf_tokenizer) -> None:
    prompts = ["Repeat this sentence: the quick brown fox jumps over the lazy dog.", "List three colors:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM()
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(speculative_method="draft_model", speculative_model=plain.engine.runner.model_path,
              num_speculative_tokens=4, speculative_disable_by_batch_size=None)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0  # the same weights agree


def test_the_draft_can_be_quantized_apart_from_the_target(tiny_dirs: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_dirs["target"]), dtype="float32", speculative_method="draft_model",
              speculative_model=str(tiny_dirs["target"]), speculative_quantization="w4a16",
              speculative_disable_by_batch_size=None)
    draft_qkv = llm.engine.scheduler.proposer.runner.model.model.layers[0].self_attn.qkv_proj
    target_qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    from loom.quant.methods import PackedLinearMethod

    assert isinstance(draft_qkv.quant_method, PackedLinearMethod) and draft_qkv.quant_method.scheme.name == "w4a16"
    assert not isinstance(target_qkv.quant_method, PackedLinearMethod)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(tiny_dirs["target"]), dtype="float32")
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == plain.generate([PROMPT], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("quantization", [None, "w4a16"])
def test_a_short_catch_up_runs_as_decode_rows_with_the_chunks_result(tiny_dirs: dict[str, Path],
                                                                     quantization: str | None) -> None:
    """decode_rows: each token a decode row of its own, only the last sampled; the same K/V and token as the chunk
    path computes, and with packed weights the one-call C decode step serves the step (it declines q_len > 1)."""
    from loom.core.sched_output import ScheduledRequest, SchedulerOutput
    from loom.spec.draft_model import _GREEDY

    results = []
    for decode_rows in (False, True):
        runner = ModelRunner(ModelConfig(model=str(tiny_dirs["other"]), dtype="float32", quantization=quantization),
                             CacheConfig(block_size=4, num_blocks=16, enable_prefix_caching=False),
                             torch.device("cpu"))

        def row(tokens: list[int], start: int, rows: bool) -> SchedulerOutput:
            req = ScheduledRequest(request_id="a", token_ids=tokens, start_position=start, block_table=[0, 1, 2],
                                   sample=True, sampling_params=_GREEDY, prompt_token_ids=[], output_token_ids=[],
                                   is_new=start == 0, decode_rows=rows)
            return SchedulerOutput([req], len(tokens))

        runner.execute_model(row(PROMPT[:6], 0, False))
        step = runner.model.model.decode_step
        served = []
        if step is not None:
            run = step.run
            step.run = lambda *a, **k: served.append(run(*a, **k)) or served[-1]
        token = runner.execute_model(row(PROMPT[6:9], 6, decode_rows)).sampled_token_ids["a"]
        if step is not None and decode_rows:
            assert served and served[-1] is not None  # the C step ran the three rows
        results.append((token, [c[:, :3].clone() for c in runner.kv_caches]))
    (chunk_token, chunk_kv), (rows_token, rows_kv) = results
    assert rows_token == chunk_token and len(rows_token) == 1
    for a, b in zip(chunk_kv, rows_kv, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    if quantization is not None:
        assert served, "the packed model should run the C decode step"
