"""Drafts of structured-output requests against their grammar (StructuredOutputManager.valid_draft_len and
.bitmasks, loom/sample/structured.py): the valid prefix, one mask per verified position equal to the mask
decoding would see there, and the matcher left exactly as it was."""

from __future__ import annotations

import json

import pytest
import torch

from loom.sample.structured import StructuredOutputManager
from loom.sampling_params import StructuredOutputParams as SO

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from loom.model.loader import load_tokenizer

    return load_tokenizer(None)


def _manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("case", ["json", "regex", "choice"])
def test_each_row_is_the_mask_after_the_drafts_before_it_and_the_matcher_is_unchanged(tokenizer, case) -> None:
    spec, text, bad = {
        "json": (SO(json=SCHEMA), '{"a": 12, "b": "yz"}', "!"),
        "regex": (SO(regex=r"[0-9]{3}-[0-9]{4}"), "555-0123", "x"),
        "choice": (SO(choice=["yes please", "no"]), "yes please", "q"),
    }[case]
    eos = tokenizer.eos_token_id
    tokens = _ids(tokenizer, text) + [eos]
    manager, reference = _manager(tokenizer), _manager(tokenizer)
    for split in range(len(tokens)):  # every point of the output, drafts = the rest, then one bad token
        out, drafts = tokens[:split], tokens[split:] + _ids(tokenizer, bad)
        valid = manager.valid_draft_len("r", spec, out, drafts)
        # all of the true continuation, EOS included, not the bad token; once the grammar is complete, EOS is
        # forced and not drafted
        assert valid == (len(tokens) - split if split < len(tokens) - 1 else 0)
        masks, num_valid = manager.bitmasks("r", spec, out, drafts)
        assert num_valid == valid and masks.shape == (len(drafts) + 1, VOCAB // 32)
        for j in range(valid + 1):
            reference.free(["q"])
            if j < len(tokens) - split:
                expected = reference.bitmask("q", spec, out + drafts[:j])
            else:  # after the final EOS the grammar is done: only EOS stays allowed
                expected = torch.zeros_like(masks[j])
                bit = 1 << (eos % 32)
                expected[eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # the int32 word's bit pattern
            assert torch.equal(masks[j], expected), (split, j)
        assert all(torch.equal(masks[j], masks[valid]) for j in range(valid + 1, len(drafts) + 1))
        assert torch.equal(manager.bitmask("r", spec, out), masks[0])  # rolled back: the same state as before
    assert manager.num_matchers == 1
    manager.free(["r"])
    assert manager.num_matchers == 0


def test_a_complete_grammar_takes_no_drafts_and_forces_eos(tokenizer) -> None:
    manager = _manager(tokenizer)
    spec = SO(choice=["no"])
    out = _ids(tokenizer, "no")
    eos = tokenizer.eos_token_id
    assert manager.valid_draft_len("r", spec, out, [eos, 5]) == 0  # stopped: EOS is forced, not drafted
    masks, num_valid = manager.bitmasks("r", spec, out, [eos, 5])
    allowed = torch.nonzero(torch.stack([(masks[0] >> b) & 1 for b in range(32)], 1).flatten()).flatten()
    assert num_valid == 0 and allowed.tolist() == [eos]
    assert torch.equal(manager.bitmask("r", spec, out), masks[0])


def test_an_out_of_vocabulary_draft_is_cut_without_breaking_the_matcher(tokenizer) -> None:
    manager = _manager(tokenizer)
    spec = SO(json=SCHEMA)
    good = _ids(tokenizer, '{"a": 1')
    assert manager.valid_draft_len("r", spec, [], good + [VOCAB + 7, 3]) == len(good)
    assert manager.valid_draft_len("r", spec, [], [-1]) == 0
    masks, num_valid = manager.bitmasks("r", spec, good, _ids(tokenizer, ', "b": "x"}'))
    assert num_valid > 0  # the matcher is still usable
    text = '{"a": 1, "b": "x"}'
    assert json.loads(text) and manager.valid_draft_len("r", spec, _ids(tokenizer, text), []) == 0


def test_an_output_that_left_its_grammar_gives_no_drafts_and_fails_its_step(tokenizer) -> None:
    manager = _manager(tokenizer)
    spec = SO(regex="[0-9]+")
    wrong = _ids(tokenizer, "abc")
    assert manager.valid_draft_len("r", spec, wrong, _ids(tokenizer, "12")) == 0  # never raises in the scheduler
    with pytest.raises(RuntimeError, match="left its grammar"):
        manager.bitmasks("r", spec, wrong, [])


def test_the_scheduler_cuts_drafts_and_gives_grammar_requests_one_branch() -> None:
    """With tree candidates on, a greedy structured-output request still gets one chain, cut to what its
    grammar accepts; an unconstrained one gets its branches."""
    from loom.config import CacheConfig, SchedulerConfig
    from loom.core.scheduler import Scheduler
    from loom.request import Request
    from loom.sampling_params import SamplingParams
    from loom.spec.proposer import PerRequestProposer

    class Fixed(PerRequestProposer):
        name = "fixed"

        def propose_candidates(self, request_id, token_ids, max_tokens, max_branches):
            return [[1, 2, 3, 4][:max_tokens], [5, 6][:max_tokens]][:max_branches]

        def propose(self, request_id, token_ids, max_tokens):
            return self.propose_candidates(request_id, token_ids, max_tokens, 1)[0]

        def request_finished(self, request_id, output_token_ids):
            pass

    class FirstTwo:
        def __init__(self) -> None:
            self.calls: list[tuple[str, list[int]]] = []

        def valid_draft_len(self, request_id, spec, output_token_ids, draft_token_ids):
            self.calls.append((request_id, list(draft_token_ids)))
            return 2

    grammar = FirstTwo()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_blocks=32), 32, proposer=Fixed(), num_speculative_tokens=4,
                          spec_disable_by_batch_size=None, spec_tree_width=2, draft_grammar=grammar)
    for rid, so in (("g", SO(regex="[0-9]+")), ("u", None)):
        scheduler.add_request(Request(request_id=rid, prompt_token_ids=[7, 8, 9],
                                      sampling_params=SamplingParams(temperature=0.0, structured_output=so),
                                      eos_token_ids=frozenset({0}), arrival_time=0.0, max_tokens=20))
    scheduler.schedule()  # the prompts
    for rid in ("g", "u"):
        scheduler.requests[rid].output_token_ids.append(11)
    step = {r.request_id: r for r in scheduler.schedule().scheduled}
    assert step["g"].spec_token_ids == [1, 2] and step["g"].spec_branches == []
    assert step["u"].spec_token_ids == [1, 2, 3, 4] and [t for t, _ in step["u"].spec_branches] == [[5, 6]]
    assert grammar.calls == [("g", [1, 2, 3, 4])]
