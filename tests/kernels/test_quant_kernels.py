"""loom's packed-weight kernels: every qgemm ISA build this CPU runs (csrc/qgemm.c through
loom/kernels/quant.py) and the torch fallback (loom/quant/torch_kernels.py), each against float64 values of
the definitions in qgemm.c's header; activation codes and scales against the torch implementation bit for
bit; dequantize bit for bit against layout.dequantize; thread-count invariance; validation; ISA dispatch.

Error bounds. Every float32 result is a sum of n terms t_i, each computed with at most a couple of
roundings (u = 2^-24 each), so whatever the order of summation |computed - exact| <= (n + c) u sum |t_i|.
The tests allow n' eps sum |t_i| with eps = 2^-23 = 2u, i.e. 2 n' >= n + c:
- C int8 path: one term per 16-value half-block (an exact integer dot times a scale product rounded
  once), one per group for the mins, one bias: n <= K/16 + groups + 1, and n' = K/32 + groups + 8;
- C weight-only path (int16 activation codes, checked bit for bit against torch's reference): one term per
  block or half-block, and per group the mins times a float sum of up to G/16 half sums, each rounded once:
  n' = K/16 + groups + 8 against the product of the dequantized codes;
- torch's float32 matmuls (its gemm_f takes the float activations): one term per product: n' = K + groups + 8.
sum |t_i| is taken element-wise (|x| |q sc| ...), which bounds the block-wise sums too. A bfloat16 output
is the float32 result rounded once to nearest even: it must equal the rounding of the float32 output.
"""

from __future__ import annotations

import pytest
import torch

from loom.kernels import build, registry
from loom.kernels.quant import QuantizedActivations
from loom.quant.layout import (PackedWeight, deinterleave_rows16, dequantize, interleavable, interleave_rows16,
                               pack_q4g, unpack_codes)
from loom.quant.torch_kernels import TorchQuantKernels

EPS = 2.0 ** -23
TORCH = TorchQuantKernels()
C_ISAS = [isa for isa in registry.kernel_isas("qgemm") if registry.get_kernel("qgemm", isa=isa) is not None]
IMPLS = [*C_ISAS, "torch"]
# q4g groups of several blocks (GPTQ / AWQ's 64 and 128, per channel; 96: a group of three blocks)
LAYOUTS = [("q4g", 32), ("q4g", 64), ("q4g", 96), ("q4g", "K"), ("q8g", 16), ("q8g", 32), ("q8g", 64), ("q8g", "K")]
MS = [1, 2, 3, 4, 5, 8, 9, 17, 64]
NS = [1, 7, 33, 577]
KS = [32, 64, 96, 576]


def kernels(impl: str):
    return TORCH if impl == "torch" else registry.get_kernel("qgemm", isa=impl)


def random_weight(layout: str, n: int, k: int, group: int, mins: bool, g: torch.Generator) -> PackedWeight:
    """Codes over their full range, float16 scales of both signs (a few tiny, subnormal ones), mins."""
    groups = k // group
    scales = torch.randn(n, groups, generator=g) * 0.05
    scales[torch.rand(n, groups, generator=g) < 0.05] = 3e-6  # float16 subnormal
    scales = scales.half()
    m = (torch.randn(n, groups, generator=g) * 0.2).half() if mins else None
    if layout == "q4g":
        return pack_q4g(torch.randint(0, 16, (n, k), generator=g), scales, m)
    return PackedWeight("q8g", torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), scales, m, group)


def random_x(m: int, k: int, dtype: torch.dtype, g: torch.Generator, strided: bool = False) -> torch.Tensor:
    """Activations with outliers and an all-zero block; `strided`: rows of a wider matrix (row stride > K)."""
    x = torch.randn(m, k + (32 if strided else 0), generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, 3] *= 20  # an outlier channel
    if k >= 64:
        x[0, 32:64] = 0  # a zero block: s = 0, codes 0
    x = x.to(dtype)
    return x[:, :k] if strided else x


def cases(layout: str, group: int | str, mins: bool) -> list[tuple]:
    """(M, N, K, bias, x dtype, per_token): every M, every N, every K the group divides, both x dtypes."""
    ks = [k for k in KS if group == "K" or k % group == 0]
    out = []
    for i, m in enumerate(MS):
        n, k = NS[(3 * i + 2) % len(NS)], ks[(i + i // len(NS)) % len(ks)]  # M = 1 gets N = 33: full groups of 4
        out.append((m, n, k, i % 3 == 0, torch.bfloat16 if i % 2 else torch.float32, i % 4 == 1))
    # one row (the by-row tiles) at every K: odd and even block counts, a q4 pair plus a lone block (K = 96)
    out += [(1, 33, k, False, torch.float32, False) for k in ks]
    return out


def group_of(group: int | str, k: int) -> int:
    return k if group == "K" else group


def min_terms(layout: str, k: int, group: int) -> int:
    """Terms of the mins' sum: one per group, but one per block of 32 for q4g (a group's min meets each of its
    blocks' x sums: the product of the weight expanded to groups of 32)."""
    return k // 32 if layout == "q4g" else k // group


def per_half(t: torch.Tensor, group: int) -> torch.Tensor:
    """A per-group [R, K / group] tensor repeated to one value per 16-half block [R, K / 16]."""
    return t.repeat_interleave(group // 16, dim=1) if group >= 16 else t


def reference_q8(xa: QuantizedActivations, w: PackedWeight, bias: torch.Tensor | None):
    """float64 value of gemm_q8's definition and the sum of |terms| (element-wise) for the bound."""
    m, k = xa.xq.shape
    n, g = w.shape[0], w.group_size
    xq = xa.xq.double().view(m, k // 16, 16)
    q = unpack_codes(w).double().view(n, k // 16, 16)
    xs_h = xa.xs.double().repeat_interleave(2, dim=1)  # [M, K/16]
    sc_h = per_half(w.scales.double(), g)  # [N, K/16]
    idot = torch.einsum("mhj,nhj->mnh", xq, q)
    adot = torch.einsum("mhj,nhj->mnh", xq.abs(), q.abs())
    y = (idot * xs_h[:, None] * sc_h[None]).sum(-1)
    s = (adot * xs_h[:, None] * sc_h.abs()[None]).sum(-1)
    if w.mins is not None:
        mn = w.mins.double()
        xsum = xa.xsum.double()
        if g == 16:
            gs = xs_h * xq.sum(-1)
            gabs = gs.abs()
        else:
            gs = xsum.view(m, k // g, g // 32).sum(-1)
            gabs = xsum.abs().view(m, k // g, g // 32).sum(-1)
        y = y + gs @ mn.T
        s = s + gabs @ mn.abs().T
    if bias is not None:
        y = y + bias.double()
        s = s + bias.double().abs()
    return y, s


def reference_f(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None):
    """float64 value of gemm_f's definition (W from the exact float16 scales and mins, unrounded) and the
    element-wise sum of |terms|."""
    n, k = w.shape
    g = w.group_size
    q = unpack_codes(w).double().view(n, k // g, g)
    wq = (q * w.scales.double().unsqueeze(-1)).view(n, k)
    wm = (torch.zeros_like(q) if w.mins is None else w.mins.double().unsqueeze(-1).expand_as(q)).reshape(n, k)
    xd = x.double()
    y = xd @ (wq + wm).T
    s = xd.abs() @ (wq.abs() + wm.abs()).T
    if bias is not None:
        y = y + bias.double()
        s = s + bias.double().abs()
    return y, s


def check_outputs(impl, run, ref: torch.Tensor, s: torch.Tensor, terms: int, label: str) -> None:
    y = run(torch.float32)
    assert y.dtype == torch.float32 and y.shape == ref.shape, label
    err = (y.double() - ref).abs()
    bound = terms * EPS * s + 1e-30
    assert torch.all(err <= bound), f"{label}: max err {err.max():.3g}, excess {(err - bound).max():.3g}"
    yb = run(torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16()), f"{label}: bf16 output != rounded float32"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,group", LAYOUTS)
@pytest.mark.parametrize("mins", [True, False])
def test_gemm_q8_matches_float64(impl: str, layout: str, group, mins: bool) -> None:
    kern = kernels(impl)
    for m, n, k, with_bias, xdtype, per_token in cases(layout, group, mins):
        g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
        gs = group_of(group, k)
        w = random_weight(layout, n, k, gs, mins, g)
        bias = torch.randn(n, generator=g) if with_bias else None
        x = random_x(m, k, xdtype, g)
        xa = kern.quantize_activations(x, per_token=per_token)
        ref, s = reference_q8(xa, w, bias)
        terms = (k // 32 if impl != "torch" else k) + min_terms(layout, k, gs) + 8
        label = f"{impl} {layout}/{gs} mins={mins} M={m} N={n} K={k} bias={with_bias} x={xdtype}"
        check_outputs(impl, lambda dt: kern.gemm_q8(xa, w, bias, dt), ref, s, terms, label)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,group", LAYOUTS)
@pytest.mark.parametrize("mins", [True, False])
def test_gemm_f_matches_float64(impl: str, layout: str, group, mins: bool) -> None:
    kern = kernels(impl)
    for m, n, k, with_bias, xdtype, strided in cases(layout, group, mins):
        g = torch.Generator().manual_seed(m * 104729 + n * 17 + k)
        gs = group_of(group, k)
        w = random_weight(layout, n, k, gs, mins, g)
        bias = torch.randn(n, generator=g) if with_bias else None
        x = random_x(m, k, xdtype, g, strided=strided)
        label = f"{impl} {layout}/{gs} mins={mins} M={m} N={n} K={k} bias={with_bias} x={xdtype} strided={strided}"
        if impl == "torch":
            ref, s = reference_f(x, w, bias)
            terms = k + k // gs + 8
        else:  # the C kernels multiply the int16 codes of x (qgemm.c, item 3)
            ref, s = reference_f(dequantize16(x), w, bias)
            terms = k // 16 + min_terms(layout, k, gs) + 8
        check_outputs(impl, lambda dt: kern.gemm_f(x, w, bias, dt), ref, s, terms, label)


def dequantize16(x: torch.Tensor) -> torch.Tensor:
    """float64 x^ = s * codes of torch's reference of the C kernels' int16 activation codes."""
    codes, scales, _ = TORCH.quantize_activations16(x)
    m, k = x.shape
    return (codes.double().view(m, k // 32, 32) * scales.double().unsqueeze(-1)).view(m, k)


@pytest.mark.parametrize("isa", C_ISAS)
def test_int16_activation_codes_equal_torch(isa: str) -> None:
    kern = kernels(isa)
    for i, (m, k) in enumerate([(1, 32), (2, 64), (3, 96), (5, 576), (17, 1536), (64, 576)]):
        for xdtype in (torch.float32, torch.bfloat16):
            x = random_x(m, k, xdtype, torch.Generator().manual_seed(i), strided=i % 2 == 1)
            got, ref = kern.quantize_activations16(x), TORCH.quantize_activations16(x)
            assert got[0].dtype == torch.int16 and got[0].shape == (m, k) and got[2].shape == (m, k // 16)
            for a, b in zip(got, ref, strict=True):
                assert torch.equal(a, b), (m, k, xdtype)
            assert int(got[0].abs().max()) == 32767  # every non-zero block reaches the full range
            # |x^ - x| <= s / 2 (+ x / s's float32 rounding, < 0.003 of a code step): ~2^-16 of the block's max|x|
            err = (dequantize16(x) - x.double()).abs().view(m, k // 32, 32).amax(-1)
            assert torch.all(err <= x.double().abs().view(m, k // 32, 32).amax(-1) * 2.0 ** -16 * 1.01)


@pytest.mark.parametrize("isa", C_ISAS)
def test_int16_codes_round_half_to_even_and_keep_nan(isa: str) -> None:
    kern = kernels(isa)
    x = torch.zeros(2, 64)
    x[0, :6] = torch.tensor([32767.0, 2.5, 3.5, -2.5, -0.5, 0.5])  # s = 1 exactly: x / s are the ties
    x[1, 40] = float("nan")
    codes, scales, halves = kern.quantize_activations16(x)
    assert scales[0, 0].item() == 1.0 and codes[0, :6].tolist() == [32767, 2, 4, -2, 0, 0]
    assert not codes[0, 32:].any() and scales[0, 1].item() == 0.0  # an all-zero block: s = 0, codes 0
    assert scales[1, 1].isnan() and halves[1, 2:].isnan().all() and not halves[1, :2].isnan().any()
    w = random_weight("q4g", 8, 64, 32, True, torch.Generator().manual_seed(0))
    w8 = random_weight("q8g", 8, 64, 32, False, torch.Generator().manual_seed(0))
    for weight in (w, w8):  # a NaN in the activations reaches the outputs, mins or not
        y = kern.gemm_f(x, weight)
        assert y[1].isnan().all() and not y[0].isnan().any()


def test_gemm_q8_is_close_to_the_float_product() -> None:
    """The int8 path approximates x W^T within the activation quantization error (a semantic check that
    the definitions, shared by all implementations, are the layout's matrix product)."""
    g = torch.Generator().manual_seed(5)
    k = 576
    for impl in IMPLS:
        kern = kernels(impl)
        for layout, group in LAYOUTS:
            gs = group_of(group, k)
            w = random_weight(layout, 64, k, gs, True, g)
            codes = unpack_codes(w).double().view(64, k // gs, gs)
            w_abs = (codes.abs() * w.scales.double().abs().unsqueeze(-1)
                     + w.mins.double().abs().unsqueeze(-1)).view(64, k)  # |sc q| + |min|
            x = torch.randn(3, k, generator=g)
            exact = x.double() @ dequantize(w).double().T
            for per_token in (False, True):
                xa = kern.quantize_activations(x, per_token=per_token)
                y = kern.gemm_q8(xa, w).double()
                # |x^ - x| <= s / 2 per element, so |y - x W^T| <= sum_k s_k / 2 (|sc q_k| + |min|)
                half_s = xa.xs.double().repeat_interleave(32, dim=1) / 2
                bound = half_s @ w_abs.T * 1.001 + 1e-4 * (x.double().abs() @ w_abs.T)
                assert torch.all((y - exact).abs() <= bound), (impl, layout, group, per_token)


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_activations_equals_torch(impl: str) -> None:
    kern = kernels(impl)
    for i, (m, k) in enumerate([(1, 32), (2, 64), (3, 96), (5, 576), (9, 576), (17, 1536), (64, 576)]):
        for xdtype in (torch.float32, torch.bfloat16):
            for per_token in (False, True):
                g = torch.Generator().manual_seed(i)
                x = random_x(m, k, xdtype, g, strided=i % 2 == 1)
                xa, ref = kern.quantize_activations(x, per_token), TORCH.quantize_activations(x, per_token)
                assert xa.xq.dtype == torch.int8 and xa.xq.shape == (m, k)
                assert xa.xs.dtype == torch.float32 and xa.xs.shape == (m, k // 32) == xa.xsum.shape
                assert torch.equal(xa.xq, ref.xq) and torch.equal(xa.xs, ref.xs), (m, k, xdtype, per_token)
                assert int(xa.xq.min()) >= -127
                blocks = x.double().reshape(m, k // 32, 32)
                # xsum: a float32 sum of 32 exact values
                bound = 32 * EPS * blocks.abs().sum(-1)
                assert torch.all((xa.xsum.double() - blocks.sum(-1)).abs() <= bound), (m, k)
                if per_token:
                    assert torch.equal(xa.xs, xa.xs[:, :1].expand(m, k // 32))
                # the definition, from float64: s = max|x| / 127 in float32, codes = round-half-even of x / s
                amax = blocks.abs().amax(-1)
                if per_token:
                    amax = amax.amax(-1, keepdim=True).expand(m, k // 32)
                assert torch.equal(xa.xs, (amax.float() / 127))


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_rounds_half_to_even(impl: str) -> None:
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5])  # s = 1 exactly: x / s are the ties
    xa = kernels(impl).quantize_activations(x)
    assert xa.xs.item() == 1.0
    assert xa.xq[0, :6].tolist() == [127, 2, 4, -2, 0, 0]
    zero = kernels(impl).quantize_activations(torch.zeros(2, 64))
    assert not zero.xq.any() and not zero.xs.any() and not zero.xsum.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,group", LAYOUTS)
def test_dequantize_is_bit_equal_to_the_layout(impl: str, layout: str, group) -> None:
    g = torch.Generator().manual_seed(11)
    for n, k in ((1, 32), (7, 96), (33, 576)):
        if group != "K" and k % group:
            continue
        for mins in (True, False):
            w = random_weight(layout, n, k, group_of(group, k), mins, g)
            w.scales[0, 0] = -0.0  # -0.0 * q and -0.0 * 0 keep their signs
            for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                out = kernels(impl).dequantize(w, dtype)
                assert out.dtype == dtype and out.shape == (n, k)
                assert torch.equal(out.view(bits), dequantize(w, dtype).view(bits)), (layout, group, n, k, mins)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,group", [("q4g", 32), ("q4g", 64), ("q8g", 16), ("q8g", 32), ("q8g", "K")])
def test_dequantize_rows_is_the_lookup_of_every_layout(impl: str, layout: str, group) -> None:
    """An embedding lookup: rows of a row-major and of a 16-row interleaved table, bit for bit the rows of the
    layout's dequantization, in the ids' order with repeats, one row (a decode step) and more rows than the
    parallel threshold (a prefill)."""
    g = torch.Generator().manual_seed(5)
    n, k = 48, 576
    for mins in (True, False):
        w = random_weight(layout, n, k, group_of(group, k), mins, g)
        full = {dtype: dequantize(w, dtype) for dtype in (torch.float32, torch.bfloat16)}
        tables = [w] + ([interleave_rows16(w)] if interleavable(w) else [])
        assert len(tables) == 2 or layout == "q8g" and group == "K"
        for table in tables:
            for ids in (torch.tensor([37]), torch.tensor([0, 47, 16, 15, 16, 3]),
                        torch.randint(0, n, (300,), generator=g), torch.tensor([], dtype=torch.int64)):
                for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                    out = kernels(impl).dequantize_rows(table, ids, dtype)
                    assert out.dtype == dtype and out.shape == (len(ids), k)
                    assert torch.equal(out.view(bits), full[dtype][ids].view(bits)), (table.layout, mins, len(ids))
            for bad in (torch.tensor([n]), torch.tensor([2, -1])):
                with pytest.raises(ValueError, match="ids must lie in"):
                    kernels(impl).dequantize_rows(table, bad)
            if impl != "torch":  # the C lookup's thread team (the suite runs one thread per worker)
                many, old = torch.randint(0, n, (700,), generator=g), torch.get_num_threads()
                try:
                    torch.set_num_threads(2)
                    two = kernels(impl).dequantize_rows(table, many)
                finally:
                    torch.set_num_threads(old)
                assert torch.equal(two, full[torch.float32][many]), (table.layout, mins)
                with pytest.raises(ValueError, match="1-D int64"):
                    kernels(impl).dequantize_rows(table, many.int())


@pytest.mark.parametrize("isa", C_ISAS)
def test_threads_do_not_change_results(isa: str) -> None:
    kern = kernels(isa)
    g = torch.Generator().manual_seed(3)
    x = random_x(9, 576, torch.float32, g)
    weights = [random_weight("q4g", 577, 576, 32, True, g), random_weight("q8g", 577, 576, 16, True, g),
               random_weight("q8g", 577, 576, 64, False, g)]
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            xa = kern.quantize_activations(torch.randn(300, 576, generator=torch.Generator().manual_seed(1)))
            outs.append([xa.xq, xa.xs, xa.xsum]
                        + [kern.gemm_q8(kern.quantize_activations(x), w) for w in weights]
                        + [kern.gemm_f(x.bfloat16(), w) for w in weights]
                        + [kern.dequantize(w, torch.bfloat16) for w in weights])
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("isa", C_ISAS)
def test_a_row_does_not_depend_on_the_batch_or_on_its_neighbours(isa: str) -> None:
    """The C kernels compute each (x row, weight row) product the same way whatever M (one row per call or
    several) and whichever rows of the weight are around it (N's grouping in fours at M = 1)."""
    kern = kernels(isa)
    g = torch.Generator().manual_seed(4)
    x = random_x(6, 576, torch.float32, g)
    for layout, group in LAYOUTS:
        w = random_weight(layout, 37, 576, group_of(group, 576), True, g)
        part = w.rows(slice(5, 12))  # starts off the grouping in fours
        full_q8 = kern.gemm_q8(kern.quantize_activations(x), w)
        full_f = kern.gemm_f(x, w)
        for i in range(6):
            xa = kern.quantize_activations(x[i : i + 1])
            assert torch.equal(kern.gemm_q8(xa, w), full_q8[i : i + 1]), (layout, group, i)
            assert torch.equal(kern.gemm_f(x[i : i + 1], w), full_f[i : i + 1]), (layout, group, i)
            assert torch.equal(kern.gemm_q8(xa, part), full_q8[i : i + 1, 5:12]), (layout, group, i)
            assert torch.equal(kern.gemm_f(x[i : i + 1], part), full_f[i : i + 1, 5:12]), (layout, group, i)


@pytest.mark.parametrize("isa", C_ISAS)
@pytest.mark.parametrize("k", [544, 576])  # 17 blocks (a lone last q4 block) and 18
def test_every_batch_size_splits_into_passes_the_same_way(isa: str, k: int) -> None:
    """A batch of M rows runs in passes over each weight row (MROWS, MROWS_Q4_16 rows of x per pass, the
    last one partial): every M from 1 to 13 gives each row the bits it gets alone."""
    kern = kernels(isa)
    g = torch.Generator().manual_seed(5)
    x = random_x(13, k, torch.float32, g)
    for layout, group in LAYOUTS:
        if k % group_of(group, k):
            continue  # groups of 64 do not divide 17 blocks
        w = random_weight(layout, 21, k, group_of(group, k), True, g)
        alone_f = torch.cat([kern.gemm_f(x[i : i + 1], w) for i in range(13)])
        alone_q8 = torch.cat([kern.gemm_q8(kern.quantize_activations(x[i : i + 1]), w) for i in range(13)])
        for m in range(2, 14):
            assert torch.equal(kern.gemm_f(x[:m], w), alone_f[:m]), (layout, group, m)
            assert torch.equal(kern.gemm_q8(kern.quantize_activations(x[:m]), w), alone_q8[:m]), (layout, group, m)


def test_empty_inputs() -> None:
    w = random_weight("q4g", 8, 64, 32, True, torch.Generator().manual_seed(0))
    for impl in IMPLS:
        kern = kernels(impl)
        x = torch.empty(0, 64)
        assert kern.gemm_q8(kern.quantize_activations(x), w).shape == (0, 8)
        assert kern.gemm_f(x, w, None, torch.bfloat16).shape == (0, 8)


@pytest.mark.parametrize("impl", IMPLS)
def test_rejects_what_it_cannot_read(impl: str) -> None:
    kern = kernels(impl)
    g = torch.Generator().manual_seed(0)
    w = random_weight("q8g", 8, 64, 32, True, g)
    x = torch.randn(2, 64)
    xa = kern.quantize_activations(x)
    with pytest.raises(ValueError, match="multiple of 32"):
        kern.quantize_activations(torch.randn(2, 48))
    with pytest.raises(ValueError, match="2-D"):
        kern.quantize_activations(torch.randn(64))
    with pytest.raises(ValueError):
        kern.quantize_activations(torch.randn(2, 64).long())
    with pytest.raises(ValueError, match="K=96"):
        kern.gemm_q8(kern.quantize_activations(torch.randn(2, 96)), w)
    with pytest.raises(ValueError, match="K=96"):
        kern.gemm_f(torch.randn(2, 96), w)
    with pytest.raises(ValueError, match="bias"):
        kern.gemm_q8(xa, w, torch.randn(7))
    with pytest.raises(ValueError, match="bias"):
        kern.gemm_f(x, w, torch.randn(8).double())
    with pytest.raises(ValueError, match="out_dtype"):
        kern.gemm_f(x, w, None, torch.int32)
    with pytest.raises(ValueError, match="xs"):
        kern.gemm_q8(QuantizedActivations(xa.xq, xa.xs.double(), xa.xsum), w)
    with pytest.raises(ValueError, match="PackedWeight"):
        kern.gemm_f(x, torch.randn(8, 64))
    with pytest.raises(ValueError, match="dtype"):
        kern.dequantize(w, torch.int8)


@pytest.mark.parametrize("isa", C_ISAS)
def test_c_bindings_reject_layouts_the_kernel_cannot_read(isa: str) -> None:
    kern = kernels(isa)
    g = torch.Generator().manual_seed(0)
    w = random_weight("q4g", 8, 64, 32, True, g)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="unit column stride"):
        kern.gemm_f(torch.randn(64, 2).T, w)
    with pytest.raises(ValueError, match="unit column stride"):
        kern.quantize_activations(torch.randn(64, 2).T)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kern.gemm_f(x.half(), w)
    with pytest.raises(ValueError, match="out_dtype"):
        kern.gemm_q8(kern.quantize_activations(x), w, None, torch.float16)
    strided = PackedWeight("q4g", torch.randint(0, 255, (8, 64), dtype=torch.uint8)[:, ::2], w.scales, w.mins, 32)
    with pytest.raises(ValueError, match="contiguous"):
        kern.gemm_f(x, strided)
    with pytest.raises(ValueError, match="contiguous"):
        kern.dequantize(strided)
    xa = kern.quantize_activations(x)
    with pytest.raises(ValueError, match="contiguous"):
        kern.gemm_q8(QuantizedActivations(xa.xq, xa.xs, torch.randn(2, 2).T), w)
    with pytest.raises(ValueError, match="bias"):
        kern.gemm_q8(xa, w, torch.randn(8).bfloat16())


needs_compiler = pytest.mark.skipif(not C_ISAS, reason="no C compiler: only the torch fallback runs")


@needs_compiler
def test_best_isa_and_the_loom_cpu_isa_cap(monkeypatch) -> None:
    best = registry.get_kernel("qgemm")
    assert best.isa == registry.kernel_isas("qgemm")[0]
    assert best.impl == {"avx512_vnni": "avx512_vnni", "avx2": "avx2", "generic": "scalar"}[best.isa]
    monkeypatch.setenv("LOOM_CPU_ISA", "generic")
    registry.clear_kernel_cache()
    try:
        capped = registry.get_kernel("qgemm")
        assert capped is not None and capped.isa == "generic" and capped.impl == "scalar"
    finally:
        monkeypatch.delenv("LOOM_CPU_ISA")
        registry.clear_kernel_cache()
    assert registry.get_kernel("qgemm").isa == best.isa


def test_no_vnni_build_on_a_cpu_without_it() -> None:
    has_vnni = registry.ISAS["avx512_vnni"].cpu_flags <= build.cpu_flags()
    kern = registry.get_kernel("qgemm", isa="avx512_vnni")
    if not has_vnni:
        assert kern is None
    elif kern is not None:  # a VNNI CPU with a compiler: it is the real VNNI code (its numerics run above)
        assert kern.impl == "avx512_vnni" and "avx512_vnni" in C_ISAS


@needs_compiler
def test_every_isa_variant_compiles() -> None:
    """The avx512_vnni build compiles here even where the CPU cannot run it (and the generic one too)."""
    for isa in registry.KERNELS["qgemm"].isas:
        path = build.build_library("qgemm", ("qgemm.c",), registry.ISAS[isa].cflags, tag=isa)
        assert path.exists() and path.stat().st_size > 0


@pytest.mark.parametrize("isa", C_ISAS)
def test_c_rotation_gives_the_reference_values(isa: str) -> None:
    """The C block Hadamard rotation (loom_rotate_rows) equals hadamard.rotate_input value for value, for every
    block size up to 512, row counts across the parallel threshold, rows of very different magnitudes, an
    all-zero block, an outlier channel and a strided view; bad blocks are refused before the C code."""
    from loom.quant.hadamard import rotate_input

    kern = kernels(isa)
    g = torch.Generator().manual_seed(11)
    for block in (1, 2, 8, 32, 64, 128, 256, 512):
        for k, m in ((block * 3, 5), (1536, 1), (1536, 130)):
            if k % block:
                continue
            x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, m).unsqueeze(1)
            x[0, :block] = 0.0
            x[-1, ::7] *= 1000.0
            assert torch.equal(kern.rotate_input(x, block), rotate_input(x, block)), (block, k, m)
    wide = torch.randn(4, 1280, generator=g)
    view = wide[:, 128:1152]  # row stride 1280
    assert torch.equal(kern.rotate_input(view, 512), rotate_input(view, 512))
    for bad in (0, 3, 1024):
        with pytest.raises(ValueError, match="rotation block"):
            kern.rotate_input(torch.zeros(2, 2048), bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_per_channel_int8_gemm_is_the_exact_integer_product(impl: str) -> None:
    """gemm_q8_per_channel: exact int32 dots of int8 codes (-128 weights and the extreme products included), then
    (float(dot) * s_w) * s_x (+ bias) in float32 — bit for bit the float64-checked integer product with that
    epilogue, at every M (so each row's bits do not depend on its batch), float32 and bfloat16 out; weights with
    groups or mins are refused."""
    kern = kernels(impl)
    g = torch.Generator().manual_seed(12)
    for m, k, n in ((1, 576, 37), (5, 96, 9), (13, 1536, 70), (64, 576, 300)):
        x = random_x(m, k, torch.float32, g)
        x[0, :32] = 1000.0  # one row's codes at +-127 in a block
        xa = kern.quantize_activations(x, per_token=True)
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        codes[0] = -128  # against +-127 activations: the largest products
        scales = (torch.rand(n, 1, generator=g) * 0.02 + 1e-4).half()
        w = PackedWeight("q8g", codes, scales, None, k)
        bias = torch.randn(n, generator=g)
        dots = (xa.xq.double() @ codes.double().t()).float()
        want = dots * scales.float().t() * xa.xs[:, :1]
        got = kern.gemm_q8_per_channel(xa, w)
        assert torch.equal(got, want), (impl, m, k, n)
        assert torch.equal(kern.gemm_q8_per_channel(xa, w, bias), want + bias)
        assert torch.equal(kern.gemm_q8_per_channel(xa, w, out_dtype=torch.bfloat16), want.bfloat16())
        rows = torch.cat([kern.gemm_q8_per_channel(kern.quantize_activations(x[i : i + 1], per_token=True), w)
                          for i in range(m)])
        assert torch.equal(rows, got)
    grouped = random_weight("q8g", 8, 64, 32, False, g)
    with pytest.raises(ValueError, match="one scale per row"):
        kern.gemm_q8_per_channel(kern.quantize_activations(torch.randn(2, 64), per_token=True), grouped)


ROW_GROUP_ISAS = [isa for isa in C_ISAS if kernels(isa).row_group_min_rows is not None]


@pytest.fixture
def row_groups_from():
    """Moves the row count from which q4g's gemm_f runs the 16-row groups (qgemm.c, gemm16_q4_nx16), for
    the test, on every build that has them; the default comes back afterwards."""
    saved = {isa: kernels(isa).row_group_min_rows for isa in ROW_GROUP_ISAS}

    def set_to(isa: str, rows: int) -> None:
        kernels(isa).set_row_group_min_rows(rows)

    yield set_to
    for isa, rows in saved.items():
        kernels(isa).set_row_group_min_rows(rows)


def test_row_groups_take_over_where_the_layer_used_to_dequantize() -> None:
    """The 16-row groups start above DENSE_MIN_ROWS_BY_LAYOUT['q4g'] rows, where PackedLinearMethod ran
    dequantization + torch's GEMM: every row count the tiles served keeps their bits. Builds without them
    report None (the AVX2 and generic builds); the avx512_vnni build has them."""
    from loom.quant.methods import DENSE_MIN_ROWS_BY_LAYOUT

    for isa in C_ISAS:
        rows = kernels(isa).row_group_min_rows
        assert rows == (DENSE_MIN_ROWS_BY_LAYOUT["q4g"] + 1 if isa == "avx512_vnni" else None), isa
        if rows is None:
            assert kernels(isa).set_row_group_min_rows(1) == -1  # nothing to move


@pytest.mark.parametrize("isa", ROW_GROUP_ISAS)
@pytest.mark.parametrize("mins", [True, False])
def test_row_groups_match_float64(isa: str, mins: bool, row_groups_from) -> None:
    """gemm_f of q4g through the 16-row groups, forced at every M: every x-row tail of a pass of 10 (M = 1-11,
    17), N in and past whole groups of 16 (a last group of 1, 15 or 1 row), odd block counts, bias, bfloat16
    and strided x, float32 and bfloat16 output; against float64 with the weight-only path's bound."""
    kern = kernels(isa)
    row_groups_from(isa, 1)
    shapes = [(1, 16, 32), (2, 17, 64), (3, 33, 96), (4, 15, 544), (5, 1, 576), (6, 48, 1536), (7, 577, 576),
              (8, 31, 160), (9, 64, 576), (10, 48, 576), (11, 16, 96), (17, 40, 576), (130, 23, 96)]
    for i, (m, n, k) in enumerate(shapes):
        g = torch.Generator().manual_seed(1000 + i)
        w = random_weight("q4g", n, k, 32, mins, g)
        bias = torch.randn(n, generator=g) if i % 2 else None
        x = random_x(m, k, torch.bfloat16 if i % 3 == 1 else torch.float32, g, strided=i % 4 == 2)
        ref, s = reference_f(dequantize16(x), w, bias)
        label = f"{isa} row groups mins={mins} M={m} N={n} K={k} bias={bias is not None} x={x.dtype}"
        check_outputs(isa, lambda dt: kern.gemm_f(x, w, bias, dt), ref, s, k // 16 + k // 32 + 8, label)


@pytest.mark.parametrize("isa", ROW_GROUP_ISAS)
def test_row_groups_give_a_row_the_same_bits_in_any_batch(isa: str, row_groups_from) -> None:
    """Through the 16-row groups a row's outputs do not depend on the other rows of x (passes of 10), on the
    weight rows beside it (groups of 16), nor on the thread count."""
    kern = kernels(isa)
    row_groups_from(isa, 1)
    g = torch.Generator().manual_seed(6)
    x = random_x(19, 576, torch.float32, g)
    w = random_weight("q4g", 70, 576, 32, True, g)
    full = kern.gemm_f(x, w)
    for i in range(19):
        assert torch.equal(kern.gemm_f(x[i : i + 1], w), full[i : i + 1]), i
    assert torch.equal(kern.gemm_f(x, w.rows(slice(5, 40))), full[:, 5:40])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kern.gemm_f(x, w), full)
    finally:
        torch.set_num_threads(old)


# ---- q4gr16: q4g with every 16 rows interleaved (layout.py), read by the 16-row groups at every M ----------

def test_interleaving_rows_is_a_reordering_that_dequantizes_the_same() -> None:
    """interleave_rows16 keeps every byte and the shapes; deinterleave_rows16 gives the q4g weight back bit for
    bit; layout.dequantize of either is the same matrix; row-major operations refuse the interleaved form;
    N % 16 != 0 is refused with the reason."""
    g = torch.Generator().manual_seed(11)
    for mins in (True, False):
        w = random_weight("q4g", 48, 96, 32, mins, g)
        r = interleave_rows16(w)
        assert r.layout == "q4gr16" and r.shape == w.shape and r.nbytes == w.nbytes
        assert not torch.equal(r.qweight, w.qweight)  # rows really moved
        assert torch.equal(torch.sort(r.qweight.flatten()).values, torch.sort(w.qweight.flatten()).values)
        back = deinterleave_rows16(r)
        assert back.layout == "q4g" and torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
        assert (back.mins is None) == (not mins) and (not mins or torch.equal(back.mins, w.mins))
        assert torch.equal(dequantize(r), dequantize(w)) and torch.equal(unpack_codes(r), unpack_codes(w))
        # word j of block b of row 16 g + r sits at [g][b][j][r]
        words, rwords = w.qweight.view(torch.int32), r.qweight.view(torch.int32).view(3, 3, 4, 16)
        assert int(rwords[1, 2, 3, 5]) == int(words[16 + 5, 2 * 4 + 3])
        assert float(r.scales.view(3, 3, 16)[2, 1, 7]) == float(w.scales[32 + 7, 1])
    ids = torch.tensor([5, 47, 16, 5, 0])  # rows of the interleaved matrix come back in the row-major layout
    got = r.rows(ids)
    assert got.layout == "q4g" and torch.equal(got.qweight, w.rows(ids).qweight)
    assert torch.equal(dequantize(got), dequantize(w)[ids])
    with pytest.raises(ValueError, match="interleaved"):
        r.cols(0, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_rows16(random_weight("q4g", 40, 64, 32, True, g))
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        interleave_rows16(random_weight("q8g", 16, 128, 64, False, g))
    for group in (16, 32):  # q8g: 8 words per block of 32
        w = random_weight("q8g", 32, 96, group, group == 32, g)
        r = interleave_rows16(w)
        assert r.layout == "q8gr16" and r.group_size == group and torch.equal(dequantize(r), dequantize(w))
        assert torch.equal(deinterleave_rows16(r).qweight, w.qweight)
        rwords = r.qweight.view(torch.int32).view(2, 3, 8, 16)
        assert int(rwords[1, 2, 5, 9]) == int(w.qweight.view(torch.int32)[16 + 9, 2 * 8 + 5])
        assert torch.equal(r.rows(torch.tensor([31, 2])).scales, w.scales[[31, 2]])


@pytest.mark.parametrize("isa", C_ISAS)
@pytest.mark.parametrize("mins", [True, False])
def test_interleaved_weights_match_float64_and_the_groups_bit_for_bit(isa: str, mins: bool, row_groups_from) -> None:
    """gemm_f of a q4gr16 weight in every build (the avx512_vnni build's 16-row groups; the others a lane at a
    time with the same arithmetic): within the weight-only bound of float64 at every pass tail, bias, bfloat16 and
    strided x, both output dtypes; and the same bits as the avx512_vnni build's groups over the q4g weight
    (forced at every M), so every machine computes one result."""
    kern = kernels(isa)
    shapes = [(1, 16, 32), (2, 32, 64), (3, 48, 96), (4, 16, 544), (7, 64, 576), (8, 16, 160), (9, 64, 576),
              (17, 48, 1536), (130, 32, 96)]
    for i, (m, n, k) in enumerate(shapes):
        g = torch.Generator().manual_seed(2000 + i)
        w = random_weight("q4g", n, k, 32, mins, g)
        r = interleave_rows16(w)
        bias = torch.randn(n, generator=g) if i % 2 else None
        x = random_x(m, k, torch.bfloat16 if i % 3 == 1 else torch.float32, g, strided=i % 4 == 2)
        ref, s = reference_f(dequantize16(x), w, bias)
        label = f"{isa} q4gr16 mins={mins} M={m} N={n} K={k} bias={bias is not None} x={x.dtype}"
        check_outputs(isa, lambda dt: kern.gemm_f(x, r, bias, dt), ref, s, k // 16 + k // 32 + 8, label)
        if ROW_GROUP_ISAS:
            row_groups_from(ROW_GROUP_ISAS[0], 1)
            assert torch.equal(kern.gemm_f(x, r, bias), kernels(ROW_GROUP_ISAS[0]).gemm_f(x, w, bias)), label


@pytest.mark.parametrize("isa", C_ISAS)
def test_interleaved_weights_give_a_row_the_same_bits_in_any_batch(isa: str) -> None:
    """With q4gr16 a row's output does not depend on how many rows its call has (1, a pass tail, past the
    tiles' 128-row limit), on which rows are beside it, nor on the thread count: what makes a prefix-cache hit,
    a batch and a speculative verify step agree with a lone fresh request bit for bit."""
    kern = kernels(isa)
    g = torch.Generator().manual_seed(12)
    x = random_x(140, 576, torch.float32, g)
    r = interleave_rows16(random_weight("q4g", 96, 576, 32, True, g))
    full = kern.gemm_f(x, r)
    for i in (0, 1, 7, 8, 9, 63, 130, 139):
        assert torch.equal(kern.gemm_f(x[i : i + 1], r), full[i : i + 1]), i
    for a, b in ((0, 9), (3, 20), (5, 134)):
        assert torch.equal(kern.gemm_f(x[a:b], r), full[a:b]), (a, b)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kern.gemm_f(x, r), full)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", C_ISAS)
def test_interleaved_weights_are_refused_where_they_cannot_be_read(isa: str) -> None:
    """gemm_q8 reads row-major layouts only; the C binding checks N % 16 even if a caller rebuilt the fields."""
    kern = kernels(isa)
    g = torch.Generator().manual_seed(13)
    r = interleave_rows16(random_weight("q4g", 16, 64, 32, True, g))
    with pytest.raises(ValueError, match="q4gr16"):
        kern.gemm_q8(kern.quantize_activations(torch.randn(2, 64)), r)
    r.qweight = r.qweight[:8]
    with pytest.raises(ValueError):
        kern.gemm_f(torch.randn(2, 64), r)



@pytest.mark.parametrize("isa", C_ISAS)
@pytest.mark.parametrize("group,mins", [(16, False), (16, True), (32, False), (32, True)])
def test_interleaved_q8_weights_match_float64_and_every_build(isa: str, group: int, mins: bool) -> None:
    """gemm_f of a q8gr16 weight (groups of 16: Q6_K; 32: Q8_0, Q5_0, Q5_1 with mins): within the weight-only
    bound of float64 at every pass tail, bias, bfloat16 and strided x, both output dtypes; the same bits in every
    build and for a row alone as in its batch."""
    kern = kernels(isa)
    best = kernels(C_ISAS[0])
    for i, (m, n, k) in enumerate([(1, 16, 32), (3, 48, 96), (8, 16, 544), (9, 64, 576), (17, 32, 1536),
                                   (130, 16, 96)]):
        g = torch.Generator().manual_seed(3000 + i)
        w = random_weight("q8g", n, k, group, mins, g)
        r = interleave_rows16(w)
        bias = torch.randn(n, generator=g) if i % 2 else None
        x = random_x(m, k, torch.bfloat16 if i % 3 == 1 else torch.float32, g, strided=i % 4 == 2)
        ref, s = reference_f(dequantize16(x), w, bias)
        label = f"{isa} q8gr16/{group} mins={mins} M={m} N={n} K={k} bias={bias is not None} x={x.dtype}"
        check_outputs(isa, lambda dt: kern.gemm_f(x, r, bias, dt), ref, s, k // 16 + k // 16 + 8, label)
        y = kern.gemm_f(x, r, bias)
        assert torch.equal(y, best.gemm_f(x, r, bias)), label
        assert torch.equal(torch.cat([kern.gemm_f(x[j : j + 1], r, bias) for j in range(m)]), y), label


@pytest.mark.parametrize("isa", C_ISAS)
@pytest.mark.parametrize("group", [64, 128, "K"])
def test_q4_groups_of_several_blocks_equal_the_weight_expanded_to_groups_of_32(isa: str, group, row_groups_from
                                                                              ) -> None:
    """A q4g (or q4gr16) weight with groups of 64, 128 or a whole row (GPTQ / AWQ's run-time layout: one float16
    scale and min per group read) gives bit for bit what the same weight with each group's scale and min repeated
    for its blocks of 32 gives, through every path of the build: gemm_f at one row (the by-row tiles), a pass
    tail and many rows (by-x tiles; the 16-row groups where the build has them, forced at every M too), gemm_q8,
    the interleaved layout, and dequantization; float32 and bfloat16 x, with and without mins and bias."""
    kern = kernels(isa)
    default = kern.row_group_min_rows
    shapes = [(1, 64, 128), (1, 33, 512), (3, 48, 256), (7, 16, 1536), (9, 80, 640), (40, 32, 384)]
    for i, (m, n, k) in enumerate(shapes):
        gs = group_of(group, k)
        if k % gs:
            continue
        g = torch.Generator().manual_seed(4000 + i)
        for mins in (True, False):
            w = random_weight("q4g", n, k, gs, mins, g)
            rep = gs // 32
            wide = PackedWeight("q4g", w.qweight, w.scales.repeat_interleave(rep, 1).contiguous(),
                                None if w.mins is None else w.mins.repeat_interleave(rep, 1).contiguous(), 32)
            assert w.nbytes < wide.nbytes
            bias = torch.randn(n, generator=g) if i % 2 else None
            x = random_x(m, k, torch.bfloat16 if i % 3 == 1 else torch.float32, g)
            label = f"{isa} q4g/{gs} mins={mins} M={m} N={n} K={k}"
            assert torch.equal(kern.gemm_f(x, w, bias), kern.gemm_f(x, wide, bias)), label
            xa = kern.quantize_activations(x)
            assert torch.equal(kern.gemm_q8(xa, w, bias), kern.gemm_q8(xa, wide, bias)), label
            assert torch.equal(kern.dequantize(w), kern.dequantize(wide)), label
            assert torch.equal(kern.dequantize(w), dequantize(w)), label
            if n % 16 == 0:
                r, rw = interleave_rows16(w), interleave_rows16(wide)
                assert torch.equal(kern.gemm_f(x, r, bias), kern.gemm_f(x, rw, bias)), label
            if isa in ROW_GROUP_ISAS:
                row_groups_from(isa, 1)
                assert torch.equal(kern.gemm_f(x, w, bias), kern.gemm_f(x, wide, bias)), label + " row groups"
                row_groups_from(isa, default)


def test_layout_constructors_refuse_what_they_cannot_pack() -> None:
    """Codes outside 0..15 (a 17 would lose its high bit, a -1 overwrite its neighbour's nibble), K not a multiple of
    32, a 1-D qweight, and a group size made a float after construction: ValueError, naming the problem (a
    fresh-user trial met silent corruption, an IndexError, a RuntimeError and a ctypes error)."""
    g = torch.Generator().manual_seed(21)
    scales = torch.ones(4, 2, dtype=torch.float16)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    for bad in (17, -1):
        c = codes.clone()
        c[1, 3] = bad
        with pytest.raises(ValueError, match="0..15"):
            pack_q4g(c, scales, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q4g(torch.zeros(4, 200, dtype=torch.int64), torch.ones(4, 2, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="2-D"):
        PackedWeight("q4g", torch.zeros(32, dtype=torch.uint8), scales, None, 32)
    w = pack_q4g(codes, scales, None)
    w.group_size = 32.0
    for isa in C_ISAS:
        with pytest.raises(ValueError, match="group_size must be an int"):
            kernels(isa).gemm_f(torch.randn(1, 64), w)
