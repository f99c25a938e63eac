"""Verifying drafted tokens against the target model: which of them a request keeps.

The target's pass over [last token] + k drafts gives k + 1 distributions p_0 .. p_k (p_i conditioned on the
drafts before i). Two acceptance rules, both exact (the emitted tokens are distributed as the target's own
autoregressive samples, and greedy output is the target's greedy output):

- `accept_sampled`, for proposers whose drafts are deterministic given the tokens (n-gram, suffix; greedy
  decoding of any proposer): draw x_i from p_i with the request's own sampler at every position, keep the
  leading drafts with x_i == d_i and then the first x_i that differs (or the bonus x_k when all matched).
  This is rejection sampling with a point-mass proposal q_i = onehot(d_i): d_i is kept with probability
  p_i(d_i) = min(1, p_i(d_i) / q_i(d_i)), and a rejected position emits x_i ~ p_i restricted to x != d_i,
  which is the residual norm(max(p_i - q_i, 0)).
- `rejection_sample`, for drafts drawn from a proposal distribution q (a draft model sampling): keep d_i
  with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from
  norm(max(p_i - q_i, 0)); after k acceptances emit a bonus token from p_k (Leviathan et al. 2023,
  Algorithm 1; Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_sampled(draft_token_ids: Sequence[int], sampled_token_ids: Sequence[int]) -> list[int]:
    """draft_token_ids [k], sampled_token_ids [k + 1] (the target's token at each verified position, drawn
    by the request's sampler) -> the emitted tokens: the leading drafts the target drew too, then the
    target's token at the first mismatch, or the bonus token after k matches (1 .. k + 1 tokens).

    Raises:
        ValueError: len(sampled_token_ids) != len(draft_token_ids) + 1.
    """
    k = len(draft_token_ids)
    if len(sampled_token_ids) != k + 1:
        raise ValueError(f"need {k + 1} sampled tokens for {k} drafts, got {len(sampled_token_ids)}")
    accepted = 0
    while accepted < k and sampled_token_ids[accepted] == draft_token_ids[accepted]:
        accepted += 1
    return list(sampled_token_ids[: accepted + 1])


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for a batch of B requests with k drafts each.

    Args:
        target_probs: [B, k + 1, vocab] float, p_0 .. p_k of each request (rows sum to 1).
        draft_token_ids: [B, k] int64, d_i drawn from q_i.
        draft_probs: [B, k, vocab] float, q_0 .. q_{k-1}, with q_i(d_i) > 0.
        generator: drawn from in a fixed order (None: torch's default).

    Returns:
        [B] the emitted tokens of each request (1 .. k + 1), distributed as k + 1 steps of sampling from
        the target.

    Raises:
        ValueError: shapes that do not agree, or q_i(d_i) == 0 for some drafted token.
    """
    if target_probs.dim() != 3 or draft_token_ids.dim() != 2:
        raise ValueError(f"target_probs must be [B, k + 1, vocab] and draft_token_ids [B, k], got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_token_ids.shape)}")
    b, k = draft_token_ids.shape
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [{b}, {k + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs.shape != (b, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be [{b}, {k}, {target_probs.shape[2]}], got {tuple(draft_probs.shape)}")
    p = target_probs.double()
    q = draft_probs.double()
    d = draft_token_ids.long()
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)  # [B, k]
    if bool((q_d <= 0).any()):
        raise ValueError("a draft token has proposal probability 0")
    p_d = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)
    u = torch.rand((b, k), generator=generator, dtype=torch.float64)
    accepted = u < p_d / q_d  # u < 1, so this is u < min(1, p/q)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] leading acceptances
    rows = torch.arange(b)
    at = num_accepted.clamp_max(k)
    last_p = p[rows, at]  # [B, vocab]: p_a (a < k: the rejected position) or p_k (bonus)
    last_q = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, at]  # q_k = 0: the bonus draws from p_k
    residual = (last_p - last_q).clamp_min(0.0)
    empty = residual.sum(dim=1, keepdim=True) <= 0.0  # p_a == q_a: rejection has probability 0; guard rounding
    residual = torch.where(empty, last_p, residual)
    final = torch.multinomial(residual / residual.sum(dim=1, keepdim=True), 1, generator=generator).squeeze(1)
    counts, drafts, finals = num_accepted.tolist(), d.tolist(), final.tolist()
    return [drafts[i][: counts[i]] + [finals[i]] for i in range(b)]
