"""Logit processing that depends on a request's history: bans, logit_bias and the three penalties.

Every function takes the batch logits `[num_reqs, vocab_size]` float32 and modifies them in place,
row by row as each request's SamplingParams asks; rows whose settings are "off" are not touched.

Sources:
- repetition penalty: Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model for
  Controllable Generation", section 4.1 (as popularised by Hugging Face: positive logits are divided
  by the penalty, negative ones multiplied, so that a penalty > 1 always lowers the probability).
- presence / frequency penalties: OpenAI API reference, "Parameter details":
  `logit -= count * frequency_penalty + (count > 0) * presence_penalty`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from loom.sampling_params import SamplingParams


class PenaltyInput(Protocol):
    """What the penalties need to know about one request (sampler.SamplingInput satisfies it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]


def check_params_against_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Check the token ids a request names against the model's vocabulary.

    The engine calls this when a request is added, so that a bad id fails that request alone
    instead of the whole batch at sampling time.

    Raises:
        ValueError: a logit_bias key or a stop_token_ids entry outside [0, vocab_size) (names the parameter).
    """
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"{name} token id {token_id} is outside the vocabulary [0, {vocab_size})")


def banned_token_ids(inp: PenaltyInput) -> set[int]:
    """Token ids that must not be sampled for this request at this step.

    Only min_tokens bans: while fewer than `min_tokens` tokens were generated, every token that would
    stop the request (the EOS set unless `ignore_eos`, and `stop_token_ids`). `ignore_eos` alone bans
    nothing: an EOS token may be sampled and generation simply goes on (vLLM's semantics), so greedy
    output with ignore_eos equals the reference model's unconstrained greedy continuation.
    """
    params = inp.params
    banned: set[int] = set()
    if len(inp.output_token_ids) < params.min_tokens:
        if not params.ignore_eos:
            banned |= inp.eos_token_ids
        banned |= set(params.stop_token_ids)
    return banned


def apply_bans(logits: torch.Tensor, inputs: Sequence[PenaltyInput]) -> None:
    """Set banned logits to -inf in place. Ids outside the vocabulary cannot be sampled and are skipped.

    Args:
        logits: [num_reqs, vocab_size] float32, modified in place.
        inputs: one per row.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, inp in enumerate(inputs):
        for token_id in banned_token_ids(inp):
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits[_index(rows, logits), _index(cols, logits)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, inputs: Sequence[PenaltyInput]) -> None:
    """Add each request's logit_bias (token id -> value) to its row, in place.

    Args:
        logits: [num_reqs, vocab_size] float32, modified in place.

    Raises:
        ValueError: a logit_bias token id outside the vocabulary (see check_params_against_vocab).
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, inp in enumerate(inputs):
        bias = inp.params.logit_bias
        if not bias:
            continue
        check_params_against_vocab(inp.params, logits.shape[1])
        for token_id, value in bias.items():
            rows.append(row)
            cols.append(token_id)
            values.append(float(value))
    if rows:
        bias_values = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_((_index(rows, logits), _index(cols, logits)), bias_values, accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, inputs: Sequence[PenaltyInput]) -> None:
    """CTRL repetition penalty over tokens present in the prompt or the output, in place.

    For each such token: logit / p when the logit is > 0, logit * p otherwise (p = repetition_penalty).
    """
    rows = [i for i, inp in enumerate(inputs) if inp.params.repetition_penalty != 1.0]
    if not rows:
        return
    seen = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool, device=logits.device)
    for k, row in enumerate(rows):
        token_ids = [*inputs[row].prompt_token_ids, *inputs[row].output_token_ids]
        seen[k, _in_vocab(token_ids, logits)] = True
    penalty = torch.tensor(
        [inputs[row].params.repetition_penalty for row in rows], dtype=logits.dtype, device=logits.device
    ).unsqueeze(1)
    sub = logits[rows]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[rows] = torch.where(seen, penalised, sub)


def apply_presence_frequency_penalties(logits: torch.Tensor, inputs: Sequence[PenaltyInput]) -> None:
    """OpenAI presence and frequency penalties over the generated tokens only, in place."""
    rows = [
        i
        for i, inp in enumerate(inputs)
        if inp.params.presence_penalty != 0.0 or inp.params.frequency_penalty != 0.0
    ]
    if not rows:
        return
    counts = torch.zeros((len(rows), logits.shape[1]), dtype=logits.dtype, device=logits.device)
    for k, row in enumerate(rows):
        token_ids = _in_vocab(inputs[row].output_token_ids, logits)
        counts[k].index_add_(0, token_ids, torch.ones(len(token_ids), dtype=logits.dtype, device=logits.device))
    frequency = torch.tensor(
        [inputs[row].params.frequency_penalty for row in rows], dtype=logits.dtype, device=logits.device
    ).unsqueeze(1)
    presence = torch.tensor(
        [inputs[row].params.presence_penalty for row in rows], dtype=logits.dtype, device=logits.device
    ).unsqueeze(1)
    logits[rows] -= counts * frequency + (counts > 0).to(logits.dtype) * presence


def modifies(inp: PenaltyInput) -> bool:
    """Whether apply_all would change this request's row at this step (a ban, a logit_bias or a penalty)."""
    params = inp.params
    return (bool(params.logit_bias) or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0 or bool(banned_token_ids(inp)))


def apply_all(logits: torch.Tensor, inputs: Sequence[PenaltyInput]) -> None:
    """Bans, then logit_bias, then repetition penalty, then presence/frequency penalties (in place)."""
    apply_bans(logits, inputs)
    apply_logit_bias(logits, inputs)
    apply_repetition_penalty(logits, inputs)
    apply_presence_frequency_penalties(logits, inputs)


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _in_vocab(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """[num_ids] int64 of the ids that fall inside the vocabulary (out-of-range ids cannot be penalised)."""
    ids = _index(token_ids, logits)
    return ids[(ids >= 0) & (ids < logits.shape[1])]
