"""Acceptance rules of speculative decoding, and the distribution test of rejection sampling."""

from __future__ import annotations

import itertools

import pytest
import torch

from loom.spec.verify import accept_sampled, rejection_sample


def test_accept_sampled_keeps_matching_drafts_then_the_target_token() -> None:
    assert accept_sampled([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept + bonus
    assert accept_sampled([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # stops at the first mismatch
    assert accept_sampled([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_sampled([], [3]) == [3]
    with pytest.raises(ValueError, match="sampled tokens"):
        accept_sampled([1, 2], [1, 2])


# A small "language model": the next-token distribution depends on the previous token (a Markov chain).
V, K = 4, 3


def _chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1).double()
    draft = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1).double()
    return target, draft


def _exact_joint(target: torch.Tensor, first: int, length: int) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, first
        for t in seq:
            prob *= float(target[prev, t])
            prev = t
        joint[seq] = prob
    return joint


def _speculative_draws(target: torch.Tensor, draft: torch.Tensor, first: int, length: int, n: int,
                       rule) -> dict[tuple[int, ...], int]:
    """n sequences of `length` tokens after `first`, each produced in rounds: draft K tokens from the draft
    chain, verify them against the target chain with `rule` (batched over the n sequences)."""
    g = torch.Generator().manual_seed(123)
    seqs: list[list[int]] = [[] for _ in range(n)]
    while True:
        active = [i for i in range(n) if len(seqs[i]) < length]
        if not active:
            break
        prev = torch.tensor([seqs[i][-1] if seqs[i] else first for i in active])
        drafts, q_rows, ctx = [], [], prev
        for _ in range(K):
            q = draft[ctx]  # [A, V]
            tok = torch.multinomial(q, 1, generator=g).squeeze(1)
            drafts.append(tok)
            q_rows.append(q)
            ctx = tok
        d = torch.stack(drafts, dim=1)  # [A, K]
        contexts = torch.cat([prev.unsqueeze(1), d], dim=1)  # [A, K + 1]
        for i, emitted in zip(active, rule(target[contexts], d, torch.stack(q_rows, dim=1), g), strict=True):
            seqs[i].extend(emitted)
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        key = tuple(seq[:length])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _total_variation(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], n: int) -> float:
    return 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())


def _wrong_rule(p: torch.Tensor, d: torch.Tensor, q: torch.Tensor, g: torch.Generator) -> list[list[int]]:
    """Accepts with p/q like rejection_sample, but a rejected position draws from p, not the residual."""
    b, k = d.shape
    p_d = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)
    num = (torch.rand((b, k), generator=g, dtype=torch.float64) < p_d / q_d).long().cumprod(1).sum(1)
    final = torch.multinomial(p[torch.arange(b), num], 1, generator=g).squeeze(1)
    return [d[i, : num[i]].tolist() + [int(final[i])] for i in range(b)]


def _point_mass_rule(p: torch.Tensor, d: torch.Tensor, q: torch.Tensor, g: torch.Generator) -> list[list[int]]:
    """accept_sampled over independent draws x_i ~ p_i (the drafts taken as fixed guesses)."""
    b, k1, v = p.shape
    sampled = torch.multinomial(p.reshape(b * k1, v), 1, generator=g).view(b, k1).tolist()
    return [accept_sampled(drafts, s) for drafts, s in zip(d.tolist(), sampled, strict=True)]


@pytest.mark.parametrize("rule", [rejection_sample, _point_mass_rule])
def test_speculative_sampling_matches_the_target_distribution(rule) -> None:
    """100k sequences of 3 tokens (64 outcomes): total variation from the exact joint below 0.02 (sampling
    noise alone gives 0.007-0.008 here, and at most ~0.01 for 64 outcomes), while a deliberately wrong
    acceptance rule is off by 0.23."""
    target, draft = _chains(0)
    exact = _exact_joint(target, first=0, length=3)
    n = 100_000
    assert _total_variation(_speculative_draws(target, draft, 0, 3, n, rule), exact, n) < 0.02
    assert _total_variation(_speculative_draws(target, draft, 0, 3, n, _wrong_rule), exact, n) > 0.1


def test_rejection_sample_checks_shapes_and_zero_proposals() -> None:
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p, torch.tensor([[1]]), torch.full((1, 1, 4), 0.25))
    with pytest.raises(ValueError, match="proposal probability 0"):
        rejection_sample(p, torch.tensor([[1, 2]]), torch.tensor([[[1.0, 0, 0, 0], [0.25] * 4]]))


def test_rejection_sample_is_greedy_exact_for_point_masses() -> None:
    """A target that is certain keeps a draft equal to its token and replaces any other."""
    p = torch.zeros(2, 3, 5)
    p[:, 0, 1] = p[:, 1, 2] = p[:, 2, 3] = 1.0
    q = torch.full((2, 2, 5), 0.2)
    out = rejection_sample(p, torch.tensor([[1, 2], [1, 4]]), q, torch.Generator().manual_seed(0))
    assert out == [[1, 2, 3], [1, 2]]
