"""The sampler: one token per request from the last-position logits. Pure functions over tensors.

Order of processing (docs/sampling.md explains each step):
1. logprobs from the RAW logits (log_softmax before anything else), when the request asks;
2. bans (-inf), logit_bias, repetition penalty, presence/frequency penalties (penalties.py), then a
   structured-output request's grammar mask (-inf for the tokens its grammar forbids; structured.py);
3. greedy rows (temperature 0) take the argmax of the processed logits;
4. other rows: divide by temperature, then top_k, top_p, min_p, then draw by inverse transform sampling.

Inverse transform sampling: with u ~ U[0, 1), the first token whose cumulative probability exceeds u is
distributed as Categorical(p); one uniform per row (a float64 running sum over the vocabulary) costs ~0.1 ms
at 49k tokens, where an exponential race (argmax p / q, q ~ Exp(1) per token) cost ~1.8 ms on a Zen 3 core.
A seeded request's uniform is a hash of (seed, output position) (`position_uniform`), so its samples
depend on nothing else: not the batch, not the row, not how many drafts a verify pass carried, not
preemption. Unseeded rows draw theirs from the engine's generator.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from loom.core.sched_output import TokenLogprobs
from loom.sample import penalties
from loom.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32.
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingInput:
    """One request that samples this step (one row of the logits)."""

    params: SamplingParams
    prompt_token_ids: list[int]  # [num_prompt_tokens], for the repetition penalty
    output_token_ids: list[int]  # [num_output_tokens] so far, for penalties and min_tokens
    eos_token_ids: frozenset[int]  # the request's end-of-sequence set (banned by ignore_eos / min_tokens)
    token_bitmask: torch.Tensor | None = None  # int32 [ceil(vocab / 32)]: allowed tokens (structured output)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]  # [num_reqs]; chosen token first then top-N; None if not asked


def sample(logits: torch.Tensor, inputs: list[SamplingInput], default_generator: torch.Generator) -> SamplerOutput:
    """Sample one token per row.

    Args:
        logits: [num_reqs, vocab_size] float32, the model's last-position logits (not modified).
        inputs: [num_reqs] one per row, in row order.
        default_generator: draws the uniforms of unseeded random rows (any device; they are made on the CPU).

    Returns:
        SamplerOutput with sampled_token_ids [num_reqs] int64.

    Raises:
        ValueError: logits not 2-D, row count != len(inputs), or a logit_bias id outside the vocabulary.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_reqs, vocab_size], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(inputs):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(inputs)} inputs were given")
    logits = logits.float()
    masked = [i for i, inp in enumerate(inputs) if inp.token_bitmask is not None]
    # the penalties and masks work in place on a copy; without any, the logits themselves are read (copying
    # 49k floats per row cost ~10-80 us of a ~5 ms single-stream token)
    penalized = any(penalties.modifies(inp) for inp in inputs)
    processed = logits.clone() if masked or penalized else logits
    if penalized:
        penalties.apply_all(processed, inputs)
    if masked:
        apply_token_bitmask(processed, masked, [inputs[i].token_bitmask for i in masked])
    sampled = greedy_argmax(processed)
    random_rows = [i for i, inp in enumerate(inputs) if inp.params.temperature >= MIN_TEMPERATURE]
    if random_rows:
        sub_inputs = [inputs[i] for i in random_rows]
        probs = truncated_probs(processed[random_rows], [inp.params for inp in sub_inputs])
        uniforms = row_uniforms(sub_inputs, default_generator)
        sampled[random_rows] = inverse_transform_sample(probs, uniforms.to(probs.device))
    return SamplerOutput(sampled_token_ids=sampled, logprobs=_requested_logprobs(logits, sampled, inputs))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab_size] -> [rows] int64: the index of each row's largest value, the first one among
    ties, and the first NaN's where a row has one (torch.argmax's rule).

    On the CPU numpy's vectorized argmax computes it (the same rule): torch's argmax over 49k float32 logits took
    ~75 us of a ~10 ms single-stream token against numpy's ~5 us (2-core Ice Lake, torch 2.13)."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0:
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype("int64", copy=False))
    return logits.argmax(dim=-1)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's bitmask forbids.

    Args:
        logits: [num_rows, vocab_size] float32.
        rows: the rows to mask.
        masks: int32 [ceil(vocab_size / 32)] each: bit t % 32 of word t // 32 set = token t allowed (llguidance's
            and xgrammar's layout). A mask that allows nothing leaves its row as it is (nothing to choose from).

    On the CPU loom's C kernel does it (csrc/token_bitmask.c); torch's ops elsewhere (and without a compiler).
    """
    words = torch.stack([m.to(torch.int32).cpu() for m in masks]).contiguous()  # [rows, words]
    kernel = _bitmask_kernel() if logits.is_cpu else None
    if kernel is not None and kernel.apply(logits, rows, words):
        return
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().reshape(len(rows), -1)[:, : logits.shape[1]]
    if allowed.shape[1] < logits.shape[1]:  # a mask shorter than the vocabulary forbids the rest
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]), value=False)
    allowed[~allowed.any(dim=1)] = True
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)


@functools.cache
def _bitmask_kernel() -> Any:
    from loom.kernels.registry import get_kernel

    return get_kernel("token_bitmask")


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p; returns the renormalised distribution.

    Args:
        logits: [num_rows, vocab_size] float32 processed logits (not modified).
        params: [num_rows] each row's settings; every temperature is >= MIN_TEMPERATURE.

    Returns:
        [num_rows, vocab_size] float32 probabilities; the most likely token always keeps mass > 0.

    top_p is nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"):
    keep the smallest set of most likely tokens whose mass reaches top_p. min_p (Nguyen et al. 2024,
    "Turning Up the Heat: Min-p Sampling") drops tokens whose probability is below min_p times the
    top token's probability.
    """
    temperature = _column([p.temperature for p in params], logits)
    scaled = logits / temperature
    if any(_uses_top_k(p, logits.shape[1]) or p.top_p < 1.0 for p in params):
        scaled = _apply_top_k_top_p(scaled, params)
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], logits)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of a seeded request at an output position (0 = its first generated token):
    SplitMix64's finalizer (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators")
    over seed and position, top 53 bits. Any int seed; position >= 0."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def row_uniforms(inputs: list[SamplingInput], default_generator: torch.Generator) -> torch.Tensor:
    """[num_rows] float64 on the CPU: position_uniform(seed, len(output so far)) for seeded rows, draws from
    default_generator (one per unseeded row, in row order) for the others."""
    unseeded = [i for i, inp in enumerate(inputs) if inp.params.seed is None]
    drawn = torch.rand(len(unseeded), dtype=torch.float64, generator=default_generator,
                       device=default_generator.device).cpu().tolist() if unseeded else []
    values = [0.0] * len(inputs)
    for i, u in zip(unseeded, drawn, strict=True):
        values[i] = u
    for i, inp in enumerate(inputs):
        if inp.params.seed is not None:
            values[i] = position_uniform(inp.params.seed, len(inp.output_token_ids))
    return torch.tensor(values, dtype=torch.float64)


def inverse_transform_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: the first index whose cumulative probability exceeds u * (row sum).

    Args:
        probs: [num_rows, vocab_size] float, each row non-negative with a positive sum.
        uniforms: [num_rows] float64 in [0, 1), on probs' device.

    Returns:
        [num_rows] int64 token ids; a token of probability 0 is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * sum can round up to the last cumulative value: take the last token that has probability
    last = probs.shape[1] - 1 - (probs.flip(-1) > 0).long().argmax(dim=-1)
    return torch.minimum(drawn, last)


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Raw logprobs of the given tokens plus the top-num_top of each row.

    Args:
        logits: [num_rows, vocab_size] float32 raw logits.
        token_ids: [num_rows] int64, the token whose logprob comes first in each row.
        num_top: how many most likely tokens follow it (>= 0).

    Returns:
        [num_rows] TokenLogprobs with 1 + num_top entries: token_ids[i] first, then the top tokens in
        descending order. Ranks are 1-based: 1 + the number of tokens with a strictly larger logprob.

    Raises:
        ValueError: num_top < 0 or larger than the vocabulary, or mismatched shapes.
    """
    if not 0 <= num_top <= logits.shape[-1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[-1]}], got {num_top}")
    if token_ids.shape != (logits.shape[0],):
        raise ValueError(f"token_ids must have shape ({logits.shape[0]},), got {tuple(token_ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.to(device=logits.device, dtype=torch.long)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    chosen_rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted, descending
    # Anything strictly larger than the j-th top value is itself among the top values, which are sorted: its
    # rank is 1 + its first position among them (a binary search, not a num_top^2 comparison).
    descending = (-top_values).contiguous()
    top_ranks = torch.searchsorted(descending, descending, right=False) + 1
    ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_values], dim=1).tolist()
    ranks = torch.cat([chosen_rank, top_ranks], dim=1).tolist()
    return [TokenLogprobs(token_ids=i, logprobs=v, ranks=r) for i, v, r in zip(ids, values, ranks)]


def _requested_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, inputs: list[SamplingInput]
) -> list[TokenLogprobs | None]:
    """Logprobs for the rows whose params.logprobs is set, computed once with the largest top-N."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(inputs)
    if not rows:
        return result
    num_top = min(max(inputs[i].params.logprobs or 0 for i in rows), logits.shape[1])
    for row, entry in zip(rows, compute_token_logprobs(logits[rows], sampled[rows], num_top)):
        keep = 1 + min(inputs[row].params.logprobs or 0, num_top)
        result[row] = TokenLogprobs(entry.token_ids[:keep], entry.logprobs[:keep], entry.ranks[:keep])
    return result


def _uses_top_k(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[num_rows, vocab_size] logits with the tokens outside top_k / top_p set to -inf (new tensor)."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    top_k = _column([p.top_k if _uses_top_k(p, vocab_size) else vocab_size for p in params], logits)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 must keep everything, even where the float cumsum creeps past 1.
    top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], logits)
    drop = (mass_before >= top_p) & (positions > 0)  # the top token is always kept
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _column(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """[len(values), 1] float32 on like's device, to broadcast one value per row."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)
