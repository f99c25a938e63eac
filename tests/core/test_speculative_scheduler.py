"""Speculative decoding in the scheduler: lookahead slots, rollback of rejected drafts, the prefix cache.

The fake runner (conftest) keeps a simulated KV cache in which every slot's state depends on all earlier
tokens, so a rejected draft whose K/V stayed in use, or a cached block holding one, changes the output.
"""

from __future__ import annotations

from typing import Any

import pytest

from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
from loom.spec import PerRequestProposer
from loom.spec.verify import accept_sampled
from tests.core.conftest import FakeRunner, make_request, make_scheduler, mix, reference_output, run_until_done, sample_from


class SpecFakeRunner(FakeRunner):
    """FakeRunner that verifies drafts: samples after every query token, keeps what accept_sampled keeps."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(sched)
        for req in sched.scheduled:
            if not req.spec_token_ids:
                continue
            start = req.start_position
            states = [self.kv[self.slot(req.block_table, start + j)] for j in range(len(req.token_ids))]
            out.sampled_token_ids[req.request_id] = accept_sampled(req.spec_token_ids, [sample_from(s) for s in states])
        return out


class OracleProposer(PerRequestProposer):
    """Proposes the true continuation, with every `wrong_every`-th draft replaced by a wrong token."""

    name = "oracle"

    def __init__(self, prompts: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.prompts = prompts
        self.wrong_every = wrong_every
        self.calls = 0
        self.finished: list[str] = []

    def request_finished(self, request_id, output_token_ids):
        self.finished.append(request_id)

    def propose(self, request_id, token_ids, max_tokens):
        for prompt, full in self.prompts.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                drafts = full[len(token_ids) - len(prompt) : len(token_ids) - len(prompt) + max_tokens]
                self.calls += 1
                if self.calls % self.wrong_every == 0 and drafts:
                    drafts = drafts[:1] + [(t + 1) % 997 for t in drafts[1:]]
                return drafts
        return []


def _with_proposer(sched: Any, proposer: Any, k: int) -> Any:
    sched.proposer = proposer
    sched.num_speculative_tokens = k
    sched.spec_stats.num_accepted_tokens_per_pos = [0] * k
    return sched


@pytest.mark.parametrize("wrong_every", [1, 2, 1000])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_drafts_never_change_the_tokens(wrong_every: int, prefix_caching: bool) -> None:
    prompts = {tuple(range(i, i + 5 + 3 * i)): 20 for i in range(4)}
    prompts[tuple(range(0, 5))] = 20  # shares a prefix with request 0 (prefix-cache hits on generated blocks)
    truth = {p: reference_output(list(p), n) for p, n in prompts.items()}
    proposer = OracleProposer(truth, wrong_every)
    sched = _with_proposer(make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=16,
                                          enable_prefix_caching=prefix_caching), proposer, 4)
    for i, (p, n) in enumerate(prompts.items()):
        sched.add_request(make_request(f"r{i}", list(p), n))
    result = run_until_done(sched, SpecFakeRunner(4))
    for i, p in enumerate(prompts):
        assert result.tokens[f"r{i}"] == truth[p], i
    assert sched.num_free_blocks == 40
    assert sorted(proposer.finished) == sorted(f"r{i}" for i in range(len(prompts)))  # each end reaches it once
    stats = sched.spec_stats
    assert stats.num_draft_tokens > 0
    if wrong_every == 1000:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert result.steps < 40  # ~5 tokens per step instead of one
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_drafts_stay_within_budget_max_tokens_and_blocks() -> None:
    prompt = list(range(7))
    truth = reference_output(prompt, 6)
    sched = _with_proposer(make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=3),
                           OracleProposer({tuple(prompt): truth}, 1000), 8)
    sched.add_request(make_request("a", prompt, 6))
    runner = SpecFakeRunner(4)
    tokens: list[int] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 3  # 1 token + at most budget - 1 drafts
        for r in out.scheduled:
            req = sched.get_request(r.request_id)
            assert len(r.token_ids) == 1 + len(r.spec_token_ids) or not r.spec_token_ids
            # drafts never reach past max_tokens: the bonus token is the last one allowed
            assert len(req.output_token_ids) + len(r.spec_token_ids) + 1 <= 6
        for core_out in sched.update_from_output(out, runner.execute(out)):
            tokens.extend(core_out.new_token_ids)
        sched.check_invariants()
    assert tokens == truth
    assert sched.num_free_blocks == 8


def test_speculation_never_preempts_more_than_plain_decoding() -> None:
    """Drafts get slots only where the pool has them free: a request without room for its drafts decodes
    one token, and no request is preempted to make room for drafts."""
    prompts = {tuple(range(10 * i, 10 * i + 8)): 8 for i in range(3)}
    truth = {p: reference_output(list(p), n) for p, n in prompts.items()}
    preemptions = []
    for proposer in (None, OracleProposer(truth, 1000)):
        sched = make_scheduler(num_blocks=8, block_size=4)
        if proposer is not None:
            _with_proposer(sched, proposer, 4)
        for i, (p, n) in enumerate(prompts.items()):
            sched.add_request(make_request(f"r{i}", list(p), n))
        result = run_until_done(sched, SpecFakeRunner(4))
        assert [result.tokens[f"r{i}"] for i in range(3)] == list(truth.values())
        assert sched.num_free_blocks == 8
        preemptions.append(sched.num_preemptions_total)
    assert preemptions[0] > 0  # the pool really was tight
    assert preemptions[1] <= preemptions[0]


class WrongProposer(PerRequestProposer):
    """Always proposes drafts the target rejects (the true next token plus one)."""

    name = "wrong"

    def __init__(self, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth = truth

    def request_finished(self, request_id, output_token_ids):
        pass

    def propose(self, request_id, token_ids, max_tokens):
        for prompt, full in self.truth.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                i = len(token_ids) - len(prompt)
                return [(t + 1) % 997 for t in full[i : i + max_tokens]]
        return []


def test_requests_whose_drafts_all_fail_back_off() -> None:
    """After a verify pass keeps nothing, the request waits 1, 2, 4, .. 16 decode steps before drafting again."""
    prompt = list(range(5))
    truth = {tuple(prompt): reference_output(prompt, 80)}
    sched = _with_proposer(make_scheduler(num_blocks=40, block_size=4), WrongProposer(truth), 4)
    sched.add_request(make_request("a", prompt, 80))
    result = run_until_done(sched, SpecFakeRunner(4))
    assert result.tokens["a"] == truth[tuple(prompt)]
    # drafts at decode steps 1, 3, 6, 11, 20, 37, 54, 71: 8 passes instead of 79
    assert sched.spec_stats.num_drafts == 8
    assert sched.spec_stats.num_accepted_tokens == 0
    assert not sched._spec_backoff  # cleaned up at finish


def test_no_drafts_while_the_batch_is_at_the_disable_limit() -> None:
    """spec_disable_by_batch_size = 2: steps with two running requests carry no drafts; once one has
    finished, the other drafts again. The tokens are the same either way."""
    prompts = {tuple(range(0, 6)): 4, tuple(range(50, 56)): 24}
    truth = {p: reference_output(list(p), n) for p, n in prompts.items()}
    sched = _with_proposer(make_scheduler(num_blocks=40, block_size=4), OracleProposer(truth, 1000), 4)
    sched.spec_disable_by_batch_size = 2
    for i, (p, n) in enumerate(prompts.items()):
        sched.add_request(make_request(f"r{i}", list(p), n))
    runner = SpecFakeRunner(4)
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    drafted_alone = 0
    while sched.has_unfinished_requests():
        running = len(sched.running)
        out = sched.schedule()
        drafts = sum(len(r.spec_token_ids) for r in out.scheduled)
        if running >= 2:
            assert drafts == 0
        elif running == 1:
            drafted_alone += drafts
        for core_out in sched.update_from_output(out, runner.execute(out)):
            tokens[core_out.request_id].extend(core_out.new_token_ids)
        sched.check_invariants()
    assert [tokens["r0"], tokens["r1"]] == list(truth.values())
    assert drafted_alone > 0
    assert sched.num_free_blocks == 40


def test_k_follows_the_running_acceptance() -> None:
    """A request whose drafts keep being rejected after the first one is drafted fewer tokens (k set by its
    per-token acceptance a: floor(a / (1 - a)) + 1); one whose drafts are all kept keeps the full k."""

    class FirstOnly(PerRequestProposer):
        """The true next token, then wrong ones: every pass keeps exactly one draft."""

        name = "first-only"

        def __init__(self, truth):
            self.truth = truth
            self.sizes: list[int] = []

        def request_finished(self, request_id, output_token_ids):
            pass

        def propose(self, request_id, token_ids, max_tokens):
            for prompt, full in self.truth.items():
                if tuple(token_ids[: len(prompt)]) == prompt:
                    i = len(token_ids) - len(prompt)
                    drafts = full[i : i + 1] + [(t + 1) % 997 for t in full[i + 1 : i + max_tokens]]
                    self.sizes.append(len(drafts))
                    return drafts
            return []

    prompt = tuple(range(9))
    truth = {prompt: reference_output(list(prompt), 40)}
    for proposer, expect_small in ((FirstOnly(truth), True), (OracleProposer(truth, 1000), False)):
        sched = _with_proposer(make_scheduler(num_blocks=40, block_size=4), proposer, 6)
        sched.add_request(make_request("a", list(prompt), 40))
        result = run_until_done(sched, SpecFakeRunner(4))
        assert result.tokens["a"] == truth[prompt]
        if expect_small:  # a = 1/2 per token -> k = 2 after a few passes
            assert proposer.sizes[0] == 6 and set(proposer.sizes[3:-2]) <= {2}, proposer.sizes
        else:
            assert sched.spec_stats.num_accepted_tokens == sched.spec_stats.num_draft_tokens
            assert result.steps <= 10  # 40 tokens at up to 7 per verify pass: k stayed at 6


def test_an_aborted_request_reaches_the_proposer_once() -> None:
    from loom.request import RequestStatus

    prompt = list(range(6))
    truth = {tuple(prompt): reference_output(prompt, 12)}
    proposer = OracleProposer(truth, 1000)
    sched = _with_proposer(make_scheduler(num_blocks=20, block_size=4), proposer, 4)
    sched.add_request(make_request("a", prompt, 12))
    runner = SpecFakeRunner(4)
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # unknown by now: ignored
    assert proposer.finished == ["a"]
    assert sched.num_free_blocks == 20
