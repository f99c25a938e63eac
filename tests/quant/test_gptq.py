"""GPTQ and RTN on the GPTQ grid (loom/quant/gptq.py) and the HF GPTQ tensor format (loom/quant/gptq_format.py)."""

from __future__ import annotations

import pytest
import torch

from loom.quant.gptq import accumulate_hessian, gptq_quantize, rtn_quantize
from loom.quant.gptq_format import (
    from_checkpoint,
    pack_int32,
    to_checkpoint,
    to_loom,
    unpack_int32,
)
from loom.quant.layout import dequantize


def correlated_inputs(k: int, rows: int, seed: int) -> torch.Tensor:
    """X [rows, k] with correlated channels and a few large ones (as LLM activations)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, :: max(1, k // 8)] *= 6.0
    return x


@pytest.mark.parametrize(("bits", "group_size", "sym", "act_order"),
                         [(4, 32, True, False), (4, 128, False, False), (4, -1, True, True), (8, 64, False, True),
                          (4, 32, False, True)])
def test_gptq_error_no_larger_than_rtn(bits: int, group_size: int, sym: bool, act_order: bool) -> None:
    n, k = 48, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(k, 1024, seed=2)
    h, count = accumulate_hessian(None, 0, x[:512])
    h, count = accumulate_hessian(h, count, x[512:])
    assert count == 1024
    torch.testing.assert_close(h, 2 * x.T @ x / 1024, rtol=1e-4, atol=1e-3)
    rtn = rtn_quantize(w, bits, group_size, sym)
    gptq = gptq_quantize(w, h, bits, group_size, sym, act_order=act_order)
    err_rtn = float((x @ (w - rtn.dequantize()).T).square().sum())
    err_gptq = float((x @ (w - gptq.dequantize()).T).square().sum())
    assert err_gptq <= err_rtn
    if bits == 4:
        assert err_gptq < 0.8 * err_rtn  # on correlated inputs GPTQ is clearly better
    assert gptq.codes.dtype == torch.int32 and int(gptq.codes.min()) >= 0 and int(gptq.codes.max()) < 2**bits
    groups = 1 if group_size == -1 else k // group_size
    assert gptq.scales.shape == (groups, n) and gptq.scales.dtype == torch.float16
    assert gptq.zeros.shape == (groups, n) and int(gptq.zeros.min()) >= 1  # v1-storable
    counts = torch.bincount(gptq.g_idx.long(), minlength=groups)
    assert bool((counts == (k if group_size == -1 else group_size)).all())
    if not act_order:
        assert torch.equal(gptq.g_idx.long(), torch.arange(k) // (k if group_size == -1 else group_size))


@pytest.mark.parametrize(("bits", "group_size", "sym"), [(4, 32, False), (4, 128, True), (8, 64, False)])
def test_static_groups_keep_the_plain_group_order(bits: int, group_size: int, sym: bool) -> None:
    """Act-order with static groups (AutoGPTQ's static_groups): columns visited by decreasing diag(H), but each
    group's scale and zero are RTN's over its consecutive columns, and g_idx is the trivial map."""
    n, k = 48, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    x = correlated_inputs(k, 1024, seed=6)
    h = 2 * x.T @ x / 1024
    assert not torch.equal(torch.argsort(torch.diagonal(h), descending=True), torch.arange(k))  # a real reorder
    rtn = rtn_quantize(w, bits, group_size, sym)
    q = gptq_quantize(w, h, bits, group_size, sym, act_order=True, static_groups=True)
    assert torch.equal(q.g_idx.long(), torch.arange(k) // group_size)
    assert torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)
    assert not torch.equal(q.codes, rtn.codes)  # the error feedback moved codes
    err_rtn = float((x @ (w - rtn.dequantize()).T).square().sum())
    err_static = float((x @ (w - q.dequantize()).T).square().sum())
    assert err_static < (0.8 if bits == 4 else 1.0) * err_rtn
    loom = to_loom(from_checkpoint(to_checkpoint(q, "gptq"), bits, "gptq"))
    assert loom.input_perm is None and loom.packed is not None  # runs without a permutation
    # without act-order, static_groups changes nothing but where the parameters come from
    plain = gptq_quantize(w, h, bits, group_size, sym, static_groups=True)
    assert torch.equal(plain.g_idx, q.g_idx) and torch.equal(plain.scales, rtn.scales)


def test_rtn_grid() -> None:
    w = torch.tensor([[-1.0, 0.5, 2.0, 0.0] * 8])
    sym = rtn_quantize(w, 4, 32, sym=True)
    assert int(sym.zeros[0, 0]) == 8
    assert float(sym.scales[0, 0]) == pytest.approx(4.0 / 15, rel=1e-3)
    asym = rtn_quantize(w, 4, -1, sym=False)
    assert torch.allclose(asym.dequantize(), w, atol=float(asym.scales[0, 0]) / 2 + 1e-6)
    pos = rtn_quantize(torch.rand(4, 32) + 1.0, 4, 32, sym=False)  # min > 0: zero 0 is not v1-storable
    assert int(pos.zeros.min()) == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**bits, (64, 48), generator=g, dtype=torch.int32)
    codes[0, :] = 2**bits - 1  # the sign bit of the packed words
    for dim in (0, 1):
        words = pack_int32(codes, bits, dim)
        assert words.dtype == torch.int32
        assert words.shape == ((64 * bits // 32, 48) if dim == 0 else (64, 48 * bits // 32))
        assert torch.equal(unpack_int32(words, bits, dim), codes)
    # the spec's bit order: code j of a word at bits j * bits
    word = pack_int32(torch.arange(32 // bits).view(-1, 1) % 2**bits, bits, 0)
    assert int(word[0, 0]) == sum(j << (j * bits) for j in range(32 // bits))


def test_v1_sym_zeros_are_0x77777777() -> None:
    w = rtn_quantize(torch.randn(16, 64), 4, 32, sym=True)
    t = to_checkpoint(w, "gptq")
    assert t["qzeros"].shape == (2, 2) and bool((t["qzeros"] == 0x77777777).all())
    assert t["qweight"].shape == (8, 16) and t["scales"].shape == (2, 16) and t["g_idx"].shape == (64,)
    assert torch.equal(to_checkpoint(w, "gptq_v2")["qzeros"], torch.full((2, 2), 0x88888888 - 2**32,
                                                                           dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize(("bits", "group_size", "sym", "act_order"),
                         [(4, 128, True, False), (4, 64, False, True), (4, 32, False, False), (4, -1, True, False),
                          (8, 128, True, True), (8, -1, False, False), (8, 32, False, True)])
def test_checkpoint_round_trip_into_loom_layouts(fmt: str, bits: int, group_size: int, sym: bool,
                                                 act_order: bool) -> None:
    n, k = 40, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(k, 512, seed=4)
    q = gptq_quantize(w, 2 * x.T @ x / 512, bits, group_size, sym, act_order=act_order)
    back = from_checkpoint(to_checkpoint(q, fmt), bits, fmt)
    for name in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, name), getattr(q, name)), name
    loom = to_loom(back)
    assert loom.dense is None and loom.packed is not None
    assert loom.packed.layout == ("q4g" if bits == 4 else "q8g")
    assert (loom.input_perm is not None) == (act_order and group_size != -1)
    reference = q.dequantize()
    ours = dequantize(loom.packed)
    if loom.input_perm is not None:
        reference = reference[:, loom.input_perm]
    if sym:  # min = -8 scale (4-bit) or none (8-bit): the file's values exactly
        assert torch.equal(ours, reference)
    else:  # the float16 min: within 2^-11 relative of zero * scale (4-bit) or (128 - zero) * scale (8-bit)
        offset = q.zeros.float() if bits == 4 else 128 - q.zeros.float()
        bound = float((offset * q.scales.float()).abs().max()) * 2**-11 * 1.01 + 1e-7
        assert float((ours - reference).abs().max()) <= bound
    xs = torch.randn(3, k)
    y_ref = xs @ q.dequantize().T
    y = (xs if loom.input_perm is None else xs[:, loom.input_perm]) @ ours.T
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=5e-2)


def test_irregular_g_idx_is_dequantized() -> None:
    q = rtn_quantize(torch.randn(8, 64), 4, 32, sym=True)
    q.g_idx = torch.tensor([0, 1] * 32, dtype=torch.int32)  # groups interleaved by one column: 32 each
    loom = to_loom(q)
    assert loom.packed is not None and loom.input_perm is not None  # a permutation fixes it
    q.g_idx = torch.tensor([0] * 16 + [1] * 32 + [0] * 16, dtype=torch.int32)
    q.g_idx[0] = 1  # 33 columns in group 1: no block of 32 is one group
    loom = to_loom(q)
    assert loom.packed is None and torch.equal(loom.dense, q.dequantize())
