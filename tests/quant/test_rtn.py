"""RTN quantizers (loom/quant/rtn.py) against the grids they promise, in float64."""

from __future__ import annotations

import pytest
import torch

from loom.quant.layout import dequantize
from loom.quant.rtn import quantize_q4g32, quantize_q8, quantize_q8_asym


def _q8_0_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """A matrix already on a Q8_0 grid: per group of 32, float16 d and codes in -127..127 reaching +-127."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -127.0, 127.0)
    return (q * d).reshape(n, k)


def _q4_1_grid(n: int, groups: int, seed: int) -> torch.Tensor:
    """A matrix already on a Q4_1 grid: per group of 32, float16 d and m, codes 0..15 reaching both ends."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, groups, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, groups, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, groups, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (q * d + m).reshape(n, groups * 32)


def test_q8_asym_reproduces_a_q8_0_grid_exactly() -> None:
    w = _q8_0_grid(64, 576, seed=0)
    packed = quantize_q8_asym(w, 32)
    assert torch.equal(dequantize(packed), w)


def test_q8_asym_reproduces_a_q4_1_grid_exactly() -> None:
    w = _q4_1_grid(32, 8, seed=1)
    rel = (dequantize(quantize_q8_asym(w, 32)) - w).abs().max() / w.abs().max()
    assert rel < 2e-3  # float16 rounding of scale (d / 17) and min'; asymmetric codes 17 q land on the grid


@pytest.mark.parametrize("group", [16, 32, 64])
def test_q8_asym_error_is_the_smaller_of_both_grids(group: int) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 192, generator=g) * torch.rand(48, 1, generator=g)
    w[:, :group] += 0.3  # groups far from zero, where the asymmetric grid wins
    ours = (dequantize(quantize_q8_asym(w, group)).double() - w.double()).view(48, -1, group).square().sum(2)
    sym = (dequantize(quantize_q8(w, group)).double() - w.double()).view(48, -1, group).square().sum(2)
    # the asymmetric grid alone, written out: scale = (max - min) / 255, codes 0..255 from min
    wg = w.view(48, -1, group)
    lo, hi = wg.amin(2, keepdim=True), wg.amax(2, keepdim=True)
    s = ((hi - lo) / 255).half().float()
    m = (lo + 128 * s).half().float()
    asym = (((wg - m) / s).round().clamp(-128, 127) * s + m - wg).double().square().sum(2)
    assert torch.all(ours <= torch.minimum(sym, asym) * (1 + 1e-6) + 1e-12)
    assert torch.any(ours < sym * 0.9) and torch.any(ours < asym * 0.9)  # both grids are used


def test_q8_asym_constant_and_zero_groups() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = 0.25
    assert torch.equal(dequantize(quantize_q8_asym(w, 32)), w)


def test_q4g_reproduces_a_q4_1_grid() -> None:
    w = _q4_1_grid(16, 4, seed=3)
    assert torch.equal(dequantize(quantize_q4g32(w)), w)
