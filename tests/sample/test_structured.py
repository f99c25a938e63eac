"""Structured output (loom/sample/structured.py, sampler.apply_token_bitmask) on the real bundled tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from loom.sample.sampler import SamplingInput, apply_token_bitmask, sample
from loom.sample.structured import StructuredOutputManager
from loom.sampling_params import SamplingParams, StructuredOutputParams as SO


@pytest.fixture(scope="module")
def tokenizer():
    from loom.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture()
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])


def _allowed(mask: torch.Tensor, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, [0], [mask])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


@pytest.mark.parametrize("path", ["c_kernel", "torch"])
def test_apply_token_bitmask_matches_a_bit_by_bit_reference(path: str, monkeypatch) -> None:
    """Both paths (loom's C kernel, the torch fallback) against the definition, with all-allowed, all-forbidden
    and partial words and a mask one word short of the vocabulary."""
    from loom.sample import sampler

    if path == "torch":
        monkeypatch.setattr(sampler, "_bitmask_kernel", lambda: None)
    else:
        assert sampler._bitmask_kernel() is not None  # the generic C build runs on every machine with a compiler
    torch.manual_seed(0)
    vocab = 130  # 4 words cover 128 tokens: 128 and 129 are beyond every mask, so forbidden
    masks = [torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32) for _ in range(3)]
    masks[1][1] = -1  # a word of 32 allowed tokens
    masks[1][2] = 0  # a word of 32 forbidden ones
    logits = torch.randn(5, vocab)
    got = logits.clone()
    rows = [0, 2, 4]
    apply_token_bitmask(got, rows, masks)
    for row, mask in zip(rows, masks, strict=True):
        for t in range(vocab):
            allowed = t < 32 * len(mask) and (int(mask[t // 32]) >> (t % 32)) & 1
            assert (got[row, t] == logits[row, t]) if allowed else got[row, t] == float("-inf")
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])  # rows without a mask: untouched
    nothing = logits.clone()
    apply_token_bitmask(nothing, [0], [torch.zeros(4, dtype=torch.int32)])
    assert torch.equal(nothing, logits)  # a mask that allows nothing leaves the row as it is


def test_a_choice_allows_only_its_prefixes_then_eos(manager, tokenizer) -> None:
    spec = SO(choice=["yes", "no"])
    first = _allowed(manager.bitmask("r", spec, []), 49152)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    yes = tokenizer.encode("yes", add_special_tokens=False)
    after = _allowed(manager.bitmask("r", spec, yes), 49152)
    assert after == {tokenizer.eos_token_id}  # complete: only the end of the sequence
    manager.free(["r"])
    assert manager.num_matchers == 0


def test_json_schema_masks_follow_the_schema(manager, tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    spec = SO(json=schema)
    prefix = tokenizer.encode('{"a": ', add_special_tokens=False)
    allowed = _allowed(manager.bitmask("r", spec, prefix), 49152)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert "1" in texts and not any(t.strip().startswith('"') for t in texts)  # an integer, not a string


def test_a_token_outside_the_grammar_is_an_error(manager, tokenizer) -> None:
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(RuntimeError, match="left its grammar"):
        manager.bitmask("r", SO(choice=["yes", "no"]), bad)


@pytest.mark.parametrize(("spec", "match"), [
    (SO(json={"type": "bogus"}), "invalid"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(regex="(unclosed"), "invalid"),
    (SO(grammar="start: undefined_rule"), "invalid"),
])
def test_bad_constraints_are_value_errors(manager, spec: SO, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        manager.compile(spec)


def test_greedy_sampling_takes_the_best_allowed_token(manager) -> None:
    spec = SO(choice=["yes", "no"])
    mask = manager.bitmask("r", spec, [])
    allowed = sorted(_allowed(mask, 49152))
    logits = torch.randn(1, 49152)
    logits[0, 0] = 100.0  # the unconstrained argmax, not allowed
    inp = SamplingInput(params=SamplingParams(temperature=0.0), prompt_token_ids=[1], output_token_ids=[],
                        eos_token_ids=frozenset(), token_bitmask=mask)
    got = int(sample(logits, [inp], torch.Generator()).sampled_token_ids[0])
    assert got == max(allowed, key=lambda t: float(logits[0, t]))


def test_structured_output_params_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_output=SO(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_output=SO(regex="a"), ignore_eos=True)
    assert json.loads(SO(json={"b": 1}).key()) == json.loads(SO(json={"b": 1}).key())


def test_schemas_differing_only_in_property_order_are_different_constraints(manager, tokenizer) -> None:
    """llguidance fixes the order of properties to the schema's: a cache key that sorted keys would serve one
    schema's grammar for the other."""
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
    assert SO(json=ab).key() != SO(json=ba).key()
    prefix = tokenizer.encode('{"', add_special_tokens=False)
    first = {tokenizer.decode([t]) for t in _allowed(manager.bitmask("ab", SO(json=ab), prefix), 49152)}
    second = {tokenizer.decode([t]) for t in _allowed(manager.bitmask("ba", SO(json=ba), prefix), 49152)}
    assert "a" in first and "b" not in first and "b" in second and "a" not in second
