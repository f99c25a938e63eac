"""What the checkpoint tests share: random calibration / evaluation windows, loom's logits of a loaded model, and the
mean KL divergence between two sets of logits."""

from __future__ import annotations

import random
from typing import Any

import torch


def windows(vocab: int, n: int = 4, length: int = 48, seed: int = 0) -> list[list[int]]:
    """n lists of `length` token ids drawn uniformly from the vocabulary (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def logits(loaded: Any, tokens: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """A LoadedModel's logits [len(tokens), vocab] float32 for one window (loom.bench.quality.window_logits)."""
    from loom.bench.quality import window_logits

    return window_logits(loaded.model, loaded.arch, tokens, kv_cache_dtype=kv_cache_dtype)


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(other)), nats, in float64."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())
