"""Speculative decoding end to end on the real model: greedy output equals decoding without it, for every
proposer (a garbage one too), alone, batched, under preemption and chunked prefill, with no block leaked."""

from __future__ import annotations

import random

import pytest

from loom import LLM, SamplingParams
from loom.spec import PerRequestProposer
from tests.helpers import run_engine_checked

# Exactness is promised in float32. The default dtype is bfloat16 on a CPU with AVX512-BF16, where logits step by
# 0.125 near 16, so a prompt whose top two tokens are 0.05 apart (PROMPTS[0]) flips with any change of kernel or
# of rounding point, a prefix-cache hit included (measured on a Sapphire Rapids-class CPU, 2026-12-02).
EXACT = {"dtype": "float32"}

CODE = """def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
"""
PROMPTS = [
    "Repeat this function exactly:\n\n" + CODE + "\nHere it is:\n\n",
    "The capital of Italy is",
    "One, two, three, four, one, two, three, four, one, two,",
    "List three colors:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


class _Garbage(PerRequestProposer):
    """A proposer that guesses random tokens."""

    name = "garbage"

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def propose(self, request_id, token_ids, max_tokens):
        return [self.rng.randrange(49152) for _ in range(max_tokens)]

    def request_finished(self, request_id, output_token_ids):
        pass


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**EXACT)


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec(request: pytest.FixtureRequest) -> LLM:
    """An engine drafting with each registered proposer, at every batch size."""
    return LLM(**EXACT, speculative_method=request.param, num_speculative_tokens=5,
               speculative_disable_by_batch_size=None)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_speculative_greedy_equals_plain_greedy(plain: LLM, spec: LLM, batched: bool) -> None:
    if batched:
        expected, got = _tokens(plain.generate(PROMPTS, GREEDY)), _tokens(spec.generate(PROMPTS, GREEDY))
    else:
        expected = [_tokens(plain.generate([p], GREEDY))[0] for p in PROMPTS]
        got = [_tokens(spec.generate([p], GREEDY))[0] for p in PROMPTS]
    assert got == expected
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0  # drafts were really verified and kept
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ... and some rejected


def test_garbage_drafts_still_give_the_exact_output(plain: LLM) -> None:
    llm = LLM(**EXACT, speculative_method="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=None)
    llm.engine.scheduler.proposer = _Garbage()
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _tokens(plain.generate(PROMPTS, GREEDY))
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.1


class _Branchy(PerRequestProposer):
    """Tree candidates with a known answer: branch 0 wrong from its first draft, branch 1 the true greedy
    continuation spoiled at a random draft (or not), branch 2 a random-length prefix of the truth."""

    name = "branchy"

    def __init__(self, truths: list[list[int]]) -> None:
        self.truths = truths
        self.rng = random.Random(1)

    def propose(self, request_id, token_ids, max_tokens):
        return self.propose_candidates(request_id, token_ids, max_tokens, 1)[0]

    def propose_candidates(self, request_id, token_ids, max_tokens, max_branches):
        truth = next(t for t in self.truths if t[: len(token_ids)] == list(token_ids))
        true = truth[len(token_ids) : len(token_ids) + max_tokens]
        if not true:
            return []
        spoiled = list(true)
        at = self.rng.randrange(len(true) + 1)
        if at < len(true):
            spoiled[at] = (spoiled[at] + 7) % 49152
        wrong = [(t + 1) % 49152 for t in true]
        branches = [wrong, spoiled, true[: self.rng.randrange(1, len(true) + 1)]]
        return [b for i, b in enumerate(branches) if i == 0 or b[0] != wrong[0]][:max_branches]

    def request_finished(self, request_id, output_token_ids):
        pass


def test_tree_candidates_keep_the_exact_output_and_free_their_blocks(plain: LLM, hf_tokenizer) -> None:
    """The longest kept run of any branch is emitted and its K/V moved into the request's blocks: the rest
    of the output, computed over those moved rows, equals plain greedy decoding; scratch blocks are all
    returned, also under preemption and chunked prefill (block_size 4: branches span several blocks), with
    prefix caching on (blocks the moved rows complete are cached with the right contents)."""
    prompts = [hf_tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _tokens(plain.generate(prompts, params))
    tree = LLM(**EXACT, speculative_method="ngram", num_speculative_tokens=5, speculative_disable_by_batch_size=None,
               speculative_tree_width=3, block_size=4, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=4,
               enable_prefix_caching=True)
    tree.engine.scheduler.proposer = _Branchy([p + e for p, e in zip(prompts, expected, strict=True)])
    assert run_engine_checked(tree.engine, prompts, params) == expected
    stats = tree.engine.scheduler.spec_stats
    assert stats.num_branch_wins > 0 and stats.num_branches > stats.num_drafts
    assert stats.num_accepted_tokens > stats.num_branch_wins  # kept runs longer than one token were moved


def test_a_failed_step_returns_the_branches_scratch_blocks(plain: LLM, hf_tokenizer) -> None:
    prompt = hf_tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = _tokens(plain.generate([prompt], params))[0]
    llm = LLM(**EXACT, speculative_method="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=None,
              speculative_tree_width=3, block_size=4)
    engine = llm.engine
    engine.scheduler.proposer = _Branchy([prompt + expected])
    runner_execute = engine.runner.execute_model

    def fail_with_branches(scheduler_output):
        if any(r.spec_branches for r in scheduler_output.scheduled):
            raise RuntimeError("injected forward failure")
        return runner_execute(scheduler_output)

    engine.runner.execute_model = fail_with_branches
    engine.add_request("0", prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in finished] == ["error"]
    engine.scheduler.check_invariants()
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks  # the scratch blocks came back


def test_tree_candidates_of_the_real_proposers(plain: LLM) -> None:
    """ngram and suffix with three branches: greedy output unchanged; a sampled request gets one branch, so
    its seeded output is the same as with speculation off."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=30, ignore_eos=True)
    expected, expected_seeded = _tokens(plain.generate(PROMPTS, GREEDY)), _tokens(plain.generate(PROMPTS[:3], seeded))
    for method, rounds in (("ngram", 1), ("suffix", 2)):
        llm = LLM(**EXACT, speculative_method=method, num_speculative_tokens=5, speculative_disable_by_batch_size=None,
                  speculative_tree_width=3)
        for _ in range(rounds):  # suffix: the second time, the global tree of earlier outputs gives other drafts
            assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
        assert llm.engine.scheduler.spec_stats.num_branches > llm.engine.scheduler.spec_stats.num_drafts
        assert _tokens(llm.generate(PROMPTS[:3], seeded)) == expected_seeded


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_rollback_under_preemption_and_chunking_keeps_outputs_and_blocks(
    plain: LLM, hf_tokenizer, prefix_caching: bool, method: str
) -> None:
    base = hf_tokenizer.encode("one two three four one two three four one two three four one two")
    prompts = [base[: 5 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    expected = _tokens(plain.generate(prompts, params))
    tight = LLM(**EXACT, speculative_method=method, num_speculative_tokens=4, speculative_disable_by_batch_size=None,
                block_size=4, num_kv_blocks=16, max_num_batched_tokens=9, max_num_seqs=6,
                enable_prefix_caching=prefix_caching)
    assert run_engine_checked(tight.engine, prompts, params) == expected
    assert tight.engine.get_stats().num_preemptions > 0
    assert tight.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_stops_and_lengths_inside_a_drafted_run(plain: LLM, spec: LLM) -> None:
    prompt = PROMPTS[2]
    free = _tokens(plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))[0]
    for max_tokens in (1, 2, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert _tokens(spec.generate([prompt], params))[0] == free[:max_tokens]
    stop_at = free[9]  # a token the drafts run through
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_at])
    got = spec.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == free[: free.index(stop_at) + 1]
    assert got.finish_reason == "stop"


def test_seeded_sampling_is_the_same_with_speculation_on_and_off(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=30, ignore_eos=True)
    first = _tokens(spec.generate(PROMPTS[:3], params))
    assert first == _tokens(plain.generate(PROMPTS[:3], params))  # a seed's noise is per position
    assert first == _tokens(spec.generate(PROMPTS[:3], params))  # the suffix cache has grown: same output
    assert first != _tokens(spec.generate(PROMPTS[:3], SamplingParams(
        temperature=0.8, top_p=0.95, seed=6, max_tokens=30, ignore_eos=True)))
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_logprobs_of_kept_drafts_equal_plain_decoding(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    a = plain.generate([PROMPTS[0]], params)[0].outputs[0]
    b = spec.generate([PROMPTS[0]], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert len(b.logprobs) == len(b.token_ids)
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        assert la.keys() == lb.keys()
        for t in la:
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4


def test_bench_prints_acceptance(spec: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    from loom.bench.cli_run import _print_spec_stats

    spec.generate([PROMPTS[0]], GREEDY)
    _print_spec_stats(spec)
    line = capsys.readouterr().out
    stats = spec.engine.get_stats()
    assert f"{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} draft tokens kept" in line
    assert "tokens per verify pass" in line
