"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864), rotate-half layout.

Scalings: "linear" (position interpolation, Chen et al. 2023, arXiv:2306.15595) and "llama3"
(frequency-dependent rescaling published with Llama 3.1: low frequencies divided by `factor`, high
ones kept, a smooth blend between low_freq_factor and high_freq_factor wavelengths), and
"freq_factors" (the same rescaling stored by llama.cpp as one divisor per frequency), and "longrope"
(LongRoPE, Ding et al. 2024, arXiv:2402.13753, as Phi-3's 128k models use it: per-frequency divisors, short ones
while a request's positions stay below original_max_position_embeddings and long ones from there, cos and sin
scaled by sqrt(1 + ln(factor) / ln(original_max_position_embeddings))).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 of RoPE with the given scaling.

    Raises:
        ValueError: rope_scaling names a type outside SUPPORTED_ROPE_TYPES, or lacks a needed key.
    """
    # float32 throughout, as the HF reference computes it, so long positions round the same way.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "longrope":  # the short factors; RotaryEmbedding adds the long table
        return _longrope_inv_freq(inv_freq, theta, head_dim, rope_scaling, "short_factor")
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: one divisor per frequency
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling freq_factors needs {inv_freq.numel()} values, got {factors.numel()}")
        return inv_freq / factors
    try:
        factor = float(rope_scaling["factor"])
        if rope_type == "linear":
            return inv_freq / factor
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks key {exc.args[0]!r}") from None
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def _longrope_inv_freq(inv_freq: torch.Tensor, theta: float, head_dim: int, rope_scaling: dict[str, Any],
                       key: str) -> torch.Tensor:
    """LongRoPE's inverse frequencies with the `key` ("short_factor" | "long_factor") divisors, computed as
    transformers does: 1 / (factor_i * theta ** (2i / d)) in float32.

    Raises:
        ValueError: the factors are missing or not head_dim / 2 of them.
    """
    if key not in rope_scaling or "original_max_position_embeddings" not in rope_scaling:
        raise ValueError(f"rope_scaling of type 'longrope' lacks {key!r} or 'original_max_position_embeddings'")
    factors = torch.tensor(rope_scaling[key], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope_scaling {key} needs {inv_freq.numel()} values, got {factors.numel()}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (factors * theta**exponents)


def longrope_attention_factor(rope_scaling: dict[str, Any], max_position: int) -> float:
    """LongRoPE's cos/sin scale: `attention_factor` if given, else sqrt(1 + ln(s) / ln(L0)) with s = `factor` (or
    max_position / L0) and L0 = original_max_position_embeddings; 1 when s <= 1."""
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    original = float(rope_scaling["original_max_position_embeddings"])
    factor = float(rope_scaling.get("factor") or max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key given each token's absolute position.

    A cos/sin table for positions [0, max_position) is precomputed in float32 (not a parameter).
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        self.register_buffer("cos_sin_cache", self._table(inv_freq, max_position, 1.0), persistent=False)
        # LongRoPE: a second table with the long factors, used for a request's tokens once its positions reach
        # original_max_position_embeddings (long_from); both tables scaled by the attention factor
        self.long_from: int | None = None
        # a buffer (None unless LongRoPE), so that moving the model to its device moves this table too
        self.register_buffer("cos_sin_cache_long", None, persistent=False)
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if kind == "longrope":
            assert rope_scaling is not None
            scale = longrope_attention_factor(rope_scaling, max_position)
            self.cos_sin_cache = self._table(inv_freq, max_position, scale)
            base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            long_inv = _longrope_inv_freq(base, theta, head_dim, rope_scaling, "long_factor")
            self.cos_sin_cache_long = self._table(long_inv, max_position, scale)
            self.long_from = int(rope_scaling["original_max_position_embeddings"])

    @staticmethod
    def _table(inv_freq: torch.Tensor, max_position: int, scale: float) -> torch.Tensor:
        """[max_position, head_dim] float32: cos then sin of each position's angles, times `scale`."""
        # Angles are formed in fp32 like the HF reference so both round identically.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return torch.cat([cos, sin], dim=-1)

    def cos_sin(self, positions: torch.Tensor, use_long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [num_tokens, 1, head_dim] float32 for positions [num_tokens] int64, as
        `apply_rotary` takes them (signed sin = [-sin, sin] over the two halves); compute once per forward
        and reuse in every layer. use_long [num_tokens] bool: the tokens that take LongRoPE's long table (None:
        the short one for all; ignored without LongRoPE).

        Raises:
            ValueError: a position is beyond the precomputed table.
        """
        # the tables' rows as apply_rotary takes them, gathered: two index_selects instead of a gather, a chunk, two
        # cats and a negation per forward (~36 -> ~9 us: a decode step calls this once per token)
        full = self._full_tables()
        try:
            cos, sin = full[1].index_select(0, positions), full[2].index_select(0, positions)
            if self.cos_sin_cache_long is not None and use_long is not None and bool(use_long.any()):
                long = self._full_tables(long=True)
                pick = use_long[:, None]
                cos = torch.where(pick, long[1].index_select(0, positions), cos)
                sin = torch.where(pick, long[2].index_select(0, positions), sin)
        except (IndexError, RuntimeError):  # out of range: the error names the parameter and the bound
            self._check_positions(positions)
            raise
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _check_positions(self, positions: torch.Tensor) -> None:
        """Raises ValueError unless every position is in [0, max_position)."""
        limit = self.cos_sin_cache.shape[0]
        if positions.numel() and (int(positions.max()) >= limit or int(positions.min()) < 0):
            raise ValueError(f"positions must be in [0, {limit}) (max_position), got {int(positions.min())}.."
                             f"{int(positions.max())}")

    def _full_tables(self, long: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the cache they were made from, cos [max_position, head_dim] = [cos, cos], signed sin = [-sin, sin]):
        exact copies of the short (long: LongRoPE's long) table's values, made on first use and again after the
        module moved (a new cache tensor)."""
        cache, key = (self.cos_sin_cache_long, "_full_long") if long else (self.cos_sin_cache, "_full")
        full = self.__dict__.get(key)
        if full is None or full[0] is not cache:
            cos, sin = cache.chunk(2, dim=-1)
            full = (cache, torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))
            self.__dict__[key] = full
        return full

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim]
        by positions [num_tokens] int64. Returns new tensors of the input dtypes."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kernels: Any = None
) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] (rotate-half pairing: i with i + head_dim/2) by the
    angles behind cos / signed_sin [num_tokens, 1, head_dim] (from `RotaryEmbedding.cos_sin`: the sin
    table negated over the first half). Returns a tensor of x's dtype.

    Same arithmetic as x * cos + cat(-x2, x1) * sin: the sign is folded into the table (exact), and the
    halves are swapped by one flip instead of neg + cat (one kernel fewer per layer). With `kernels`
    (loom's fused CPU ops), x is rotated in one C call with the same roundings (equal bit for bit).
    """
    if kernels is not None:
        out = kernels.rotary(x, cos, signed_sin)
        if out is not None:
            return out
    n, heads, dim = x.shape
    x32 = x.float()  # one upcast; swapping halves is exact, so rotating x32 rounds the same
    swapped = x32.view(n, heads, 2, dim // 2).flip(2).view(n, heads, dim)  # [x2, x1]
    return (x32 * cos + swapped * signed_sin).to(x.dtype)
