"""Structured output with speculative decoding on the real model: drafts are cut to what the grammar accepts,
every verified position is masked with the grammar's state after the drafts before it, and greedy output
equals decoding without speculation (float32), alone and batched with unconstrained and other drafting
requests; no KV block or grammar matcher is left behind on any path (finished, aborted, failed step)."""

from __future__ import annotations

import json
import re

import pytest

from loom import LLM, SamplingParams
from loom.sampling_params import StructuredOutputParams as SO
from tests.e2e.test_speculative import EXACT, PROMPTS, _Garbage, _tokens
from tests.helpers import run_engine_checked

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Rome"]}, "tags": {"type": "array", "items": {"type": "string",
                                                                                       "maxLength": 12},
                                                       "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
RECORD = '{"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "poetry"]}'
# prompts an n-gram or suffix proposer can draft from: the answer copies text of the prompt
JSON_PROMPT = f"Copy this record exactly, as JSON:\n{RECORD}\n{RECORD}\nThe record:\n"
REGEX_PROMPT = "Phone numbers: 555-0101, 555-0102, 555-0103, 555-0104. The next one is "
CHOICE_PROMPT = "Is the sky blue? Answer yes or no. Is grass green? Answer yes or no. Answer:"
CONSTRAINED = [
    (JSON_PROMPT, SamplingParams(temperature=0.0, max_tokens=60, structured_output=SO(json=SCHEMA))),
    (REGEX_PROMPT, SamplingParams(temperature=0.0, max_tokens=40,
                                  structured_output=SO(regex=r"555-[0-9]{4}(, 555-[0-9]{4}){0,2}\."))),
    (CHOICE_PROMPT, SamplingParams(temperature=0.0, max_tokens=8, structured_output=SO(choice=[" yes", " no"]))),
]
FREE = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _check_valid(texts: list[str]) -> None:
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"555-[0-9]{4}(, 555-[0-9]{4}){0,2}\.", texts[1]), texts[1]
    assert texts[2] in (" yes", " no"), texts[2]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**EXACT)


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec(request: pytest.FixtureRequest) -> LLM:
    return LLM(**EXACT, speculative_method=request.param, num_speculative_tokens=5,
               speculative_disable_by_batch_size=None)


@pytest.fixture(scope="module")
def plain_tokens(plain: LLM):
    """Greedy tokens without speculation, alone (one request at a time) or batched: computed once for the module,
    not once per speculative method (float32 greedy on one engine: the same tokens each time)."""
    cache: dict[bool, list[list[int]]] = {}

    def tokens(batched: bool) -> list[list[int]]:
        if batched not in cache:
            pairs = CONSTRAINED + [(p, FREE) for p in PROMPTS] if batched else CONSTRAINED
            cache[batched] = _tokens(_run(plain, pairs)) if batched else [_tokens(_run(plain, [pair]))[0]
                                                                           for pair in pairs]
        return cache[batched]

    return tokens


def _run(llm: LLM, pairs: list[tuple[str, SamplingParams]]):
    return llm.generate([p for p, _ in pairs], [s for _, s in pairs], use_tqdm=False)


def _clean(llm: LLM) -> None:
    engine = llm.engine
    engine.scheduler.check_invariants()
    assert engine.structured.num_matchers == 0
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_structured_greedy_with_speculation_equals_without(plain_tokens, spec: LLM, batched: bool) -> None:
    """json_schema, regex and choice: the same tokens as without speculation, valid, and drafts really kept;
    batched, next to unconstrained requests that draft too (their output unchanged as well)."""
    pairs = CONSTRAINED + [(p, FREE) for p in PROMPTS] if batched else CONSTRAINED
    expected = plain_tokens(batched)
    before = spec.engine.scheduler.spec_stats.num_accepted_tokens
    outs = _run(spec, pairs) if batched else [_run(spec, [pair])[0] for pair in pairs]
    assert _tokens(outs) == expected
    _check_valid([o.outputs[0].text for o in outs[:3]])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:3])
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > before
    _clean(spec)


class _HalfRight(_Garbage):
    """Up to half of the true continuation, then random tokens: the grammar cuts drafts inside the run."""

    name = "half-right"

    def __init__(self, truths: list[list[int]]) -> None:
        super().__init__()
        self.truths = truths

    def propose(self, request_id, token_ids, max_tokens):
        truth = next(t for t in self.truths if t[: len(token_ids)] == list(token_ids))
        true = truth[len(token_ids) : len(token_ids) + self.rng.randrange(max_tokens // 2 + 1)]
        return (true + super().propose(request_id, token_ids, max_tokens))[:max_tokens]


def test_drafts_reach_verification_only_as_far_as_the_grammar_accepts(plain: LLM, hf_tokenizer) -> None:
    """Partly random drafts: the scheduler cuts each structured request's drafts to its grammar's valid prefix
    (so every draft verified is one the grammar accepts) and the output is still exact."""
    pairs = [(hf_tokenizer.encode(p), s) for p, s in CONSTRAINED]
    expected = _tokens(_run(plain, pairs))
    llm = LLM(**EXACT, speculative_method="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=None)
    llm.engine.scheduler.proposer = _HalfRight([p + out for (p, _), out in zip(pairs, expected, strict=True)])
    verified: list[tuple[int, int]] = []
    bitmasks = llm.engine.structured.bitmasks

    def recording(request_id, spec, output_token_ids, draft_token_ids):
        masks, num_valid = bitmasks(request_id, spec, output_token_ids, draft_token_ids)
        verified.append((len(draft_token_ids), num_valid))
        return masks, num_valid

    llm.engine.structured.bitmasks = recording
    assert _tokens(_run(llm, pairs)) == expected
    assert any(n > 0 for n, _ in verified)  # drafts were verified ...
    assert all(n == valid for n, valid in verified)  # ... only ones the grammar accepts
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    _clean(llm)


def test_blocks_and_matchers_under_preemption_abort_and_failure(plain: LLM, hf_tokenizer) -> None:
    """Small pool and budget (preemption, chunked prefill), invariants after every step; then an abort and
    a failed step in the middle of drafting leave no block and no matcher."""
    prompts = [hf_tokenizer.encode(JSON_PROMPT)] * 2
    params = CONSTRAINED[0][1]
    expected = _tokens(plain.generate(prompts, params, use_tqdm=False))
    tight = LLM(**EXACT, speculative_method="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=None,
                block_size=4, num_kv_blocks=44, max_num_batched_tokens=32, max_num_seqs=2,
                enable_prefix_caching=False)
    engine = tight.engine
    assert run_engine_checked(engine, prompts, params) == expected
    assert engine.get_stats().num_preemptions > 0 and engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert engine.structured.num_matchers == 0

    engine.add_request("a", prompts[0], params)
    drafts = engine.scheduler.spec_stats.num_drafts
    while engine.scheduler.spec_stats.num_drafts == drafts:  # until it verified drafts
        engine.step()
    assert engine.structured.num_matchers == 1
    engine.abort_request(["a"])
    _clean(tight)

    runner_execute = engine.runner.execute_model

    def fail_when_drafting(scheduler_output):
        if any(r.spec_token_ids for r in scheduler_output.scheduled):
            raise RuntimeError("injected forward failure")
        return runner_execute(scheduler_output)

    engine.runner.execute_model = fail_when_drafting
    engine.add_request("f", prompts[0], params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished and o.request_id == "f"]
    assert [o.outputs[0].finish_reason for o in finished] == ["error"]
    engine.runner.execute_model = runner_execute
    _clean(tight)


def test_seeded_sampling_with_a_grammar_is_the_same_with_speculation_on_and_off(plain: LLM, spec: LLM) -> None:
    """Sampled rows are masked too: a seeded constrained request draws the same tokens, and stays valid."""
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=60, structured_output=SO(json=SCHEMA))
    expected = _tokens(plain.generate([JSON_PROMPT], params, use_tqdm=False))
    out = spec.generate([JSON_PROMPT], params, use_tqdm=False)
    assert _tokens(out) == expected
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMA)
