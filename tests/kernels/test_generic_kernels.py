"""loom's portable CPU kernels (loom/kernels/csrc/paged_decode.c, fused_ops.c, gemv_w16.c; bindings in
loom/kernels/cpu_generic.py), every ISA variant this CPU runs (avx2 and generic on an x86 CPU with AVX2,
generic anywhere): numerics against float64 references and torch, validation."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from loom.kernels.registry import get_kernel, kernel_isas

from tests.kernels.test_cpu_kernels import bf16_ulp

# torch's own vectorized CPU kernels (8 or 16 float lanes) are what the fused float32 ops reproduce bit for bit
TORCH_X86 = torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX2", "AVX512"))


def reference_decode(q, kv_cache, block_table, seq_lens, scale, window):
    """float64 softmax attention of each request's one query over its own keys (GQA by repeat)."""
    batch, heads, dim = q.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        slots = [int(block_table[b, t // block_size]) * block_size + t % block_size for t in range(n)]
        k = kv_cache[0].reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        v = kv_cache[1].reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if window:
            s[:, : max(0, n - window)] = float("-inf")
        out[b] = torch.einsum("ht,thd->hd", s.softmax(-1), v)
    return out


def kernel_or_skip(name: str, isa: str):
    kernel = get_kernel(name, isa=isa)
    if kernel is None:
        pytest.skip(f"{name} ({isa}) does not build here (no C compiler?)")
    assert kernel.isa == isa
    return kernel


def f32_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float32 numbers around |x| (24 significand bits; normal numbers)."""
    exp = torch.floor(torch.log2(x.double().abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, exp - 23)


def test_the_generic_variants_are_listed_for_every_cpu() -> None:
    for name in ("paged_decode", "fused_ops", "gemv_w16"):
        isas = kernel_isas(name)
        assert isas[-1] == "generic"


# ---------------------------------------------------------------- paged decode

# (query dtype, cache dtype): one dtype, or 16-bit cache rows under float32 / bfloat16 queries
QUERY_AND_CACHE = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                   (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
@pytest.mark.parametrize("dtype,kv_dtype", QUERY_AND_CACHE)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (2, 1, 256), (5, 1, 40),
                                                (12, 3, 24)])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_matches_float64_attention(isa: str, dtype: torch.dtype, kv_dtype: torch.dtype, heads: int,
                                                kv_heads: int, dim: int, window: int | None) -> None:
    paged = kernel_or_skip("paged_decode", isa)
    g = torch.Generator().manual_seed(heads * 100 + dim)
    block_size, num_blocks = 4, 64
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    seq_lens = torch.tensor([1, 3, 4, 5, 17, 33, 150], dtype=torch.int64)
    block_table = torch.stack([torch.randperm(num_blocks, generator=g)[:40] for _ in seq_lens])  # int64
    q = (torch.randn(len(seq_lens), heads, dim, generator=g) * 2).to(dtype)
    scale = dim ** -0.5
    assert paged.supports(q, kv_cache)
    ref = reference_decode(q, kv_cache, block_table, seq_lens, scale, window)
    for threads in (1, 2):
        out = paged(q, kv_cache, block_table, seq_lens, scale, window, num_threads=threads)
        assert out.dtype == dtype and out.shape == q.shape
        if dtype == torch.float32:  # float32 sums of a few hundred terms (16-bit cache values widen exactly)
            assert torch.allclose(out.double(), ref, rtol=1e-5, atol=2e-6), (out.double() - ref).abs().max()
        else:  # float32 arithmetic, one bf16 rounding of the output
            assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-3), (out.double() - ref).abs().max()


@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
@pytest.mark.parametrize("dtype,kv_dtype", QUERY_AND_CACHE)
@pytest.mark.parametrize("window", [None, 300])
def test_paged_decode_splits_long_contexts_over_threads(isa: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                                                        window: int | None) -> None:
    """Few requests, long contexts: each request's keys are split into ranges merged afterwards (one range of
    the short request is empty)."""
    paged = kernel_or_skip("paged_decode", isa)
    g = torch.Generator().manual_seed(7)
    block_size, num_blocks = 16, 160
    kv_cache = torch.randn(2, num_blocks, block_size, 3, 64, generator=g).to(kv_dtype)
    seq_lens = torch.tensor([1000, 3], dtype=torch.int64)
    block_table = torch.stack([torch.randperm(num_blocks, generator=g)[:63] for _ in seq_lens])
    q = (torch.randn(2, 9, 64, generator=g) * 3).to(dtype)
    ref = reference_decode(q, kv_cache, block_table, seq_lens, 0.125, window)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for threads in (1, 2):
        out = paged(q, kv_cache, block_table, seq_lens, 0.125, window, num_threads=threads)
        assert torch.allclose(out.double(), ref, **tol), (threads, (out.double() - ref).abs().max())
        single = paged(q[:1], kv_cache, block_table[:1], seq_lens[:1], 0.125, window, num_threads=threads)
        assert torch.allclose(single.double(), ref[:1], **tol)



@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 200])
def test_paged_decode_gives_a_request_the_same_bits_in_any_batch(isa: str, kv_dtype: torch.dtype,
                                                                 window: int | None) -> None:
    """A request's output does not depend on the batch it runs in (alone, where its key ranges are the threads'
    work items, or among 12, where each thread takes whole requests) nor on the thread count: its ranges and
    their merge are fixed by its own length. What lets batched, speculative and lone decoding agree bit for bit."""
    paged = kernel_or_skip("paged_decode", isa)
    g = torch.Generator().manual_seed(21)
    block_size, num_blocks = 16, 256
    kv_cache = torch.randn(2, num_blocks, block_size, 3, 64, generator=g).to(kv_dtype)
    seq_lens = torch.tensor([1, 63, 64, 65, 129, 300, 1000, 17, 256, 257, 700, 5], dtype=torch.int64)
    block_table = torch.stack([torch.randperm(num_blocks, generator=g)[:64] for _ in seq_lens])
    q = torch.randn(len(seq_lens), 9, 64, generator=g) * 3
    full = paged(q, kv_cache, block_table, seq_lens, 0.125, window, num_threads=2)
    for b in range(len(seq_lens)):
        for threads in (1, 2, 3):
            alone = paged(q[b : b + 1], kv_cache, block_table[b : b + 1], seq_lens[b : b + 1], 0.125, window,
                          num_threads=threads)
            assert torch.equal(alone, full[b : b + 1]), (b, threads)
    assert torch.equal(paged(q[2:5], kv_cache, block_table[2:5], seq_lens[2:5], 0.125, window, num_threads=2),
                       full[2:5])

def test_generic_paged_decode_takes_any_head_dim() -> None:
    paged = kernel_or_skip("paged_decode", "generic")
    for (heads, kv_heads, dim), kv_dtype in itertools.product(((3, 1, 12), (2, 2, 7)),
                                                             (torch.float32, torch.float16, torch.bfloat16)):
        kv_cache = torch.randn(2, 10, 4, kv_heads, dim).to(kv_dtype)  # 16-bit rows: widened once per tile
        table = torch.randperm(10)[None, :6].repeat(2, 1)
        seq_lens = torch.tensor([6, 21], dtype=torch.int64)
        q = torch.randn(2, heads, dim)
        out = paged(q, kv_cache, table, seq_lens, 0.3, None)
        assert torch.allclose(out.double(), reference_decode(q, kv_cache, table, seq_lens, 0.3, None), atol=1e-6)


@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
def test_paged_decode_reads_through_a_strided_block_table(isa: str) -> None:
    paged = kernel_or_skip("paged_decode", isa)
    for dtype in (torch.float32, torch.bfloat16):
        kv_cache = torch.randn(2, 8, 4, 1, 32).to(dtype)
        table = torch.arange(16, dtype=torch.int64).remainder(8).reshape(2, 8)[:, :3]  # row stride 8
        seq_lens = torch.tensor([9, 12], dtype=torch.int64)
        q = torch.randn(2, 2, 32).to(dtype)
        out = paged(q, kv_cache, table, seq_lens, 0.2)
        assert torch.allclose(out.double(), reference_decode(q, kv_cache, table, seq_lens, 0.2, None), atol=1e-2)


@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
def test_paged_decode_refuses_what_it_cannot_serve(isa: str) -> None:
    paged = kernel_or_skip("paged_decode", isa)
    kv = torch.randn(2, 4, 4, 2, 64)
    table = torch.zeros(1, 2, dtype=torch.int64)
    assert paged.supports(torch.randn(1, 4, 64), kv) and paged.supports(torch.randn(1, 4, 64).bfloat16(), kv.bfloat16())
    assert paged.supports(torch.randn(1, 4, 64), kv.half()) and paged.supports(torch.randn(1, 4, 64), kv.bfloat16())
    assert paged.supports(torch.randn(1, 4, 64).bfloat16(), kv.half())  # 16-bit caches under either query
    assert not paged.supports(torch.randn(1, 4, 64).bfloat16(), kv)  # a float32 cache under bfloat16 queries
    assert not paged.supports(torch.randn(1, 4, 64).half(), kv.half())  # float16 queries
    fp8 = torch.zeros(2, 4, 4, 2, 68).to(torch.float8_e4m3fn)  # fp8 rows (64 values + a float32 scale)
    assert not paged.supports(torch.randn(1, 4, 64), fp8)  # fp8 caches gather instead
    assert not paged.supports(torch.randn(1, 3, 64), kv)  # 3 heads over 2 KV heads
    assert not paged.supports(torch.randn(1, 4, 32), kv)  # head_dim differs
    assert not paged.supports(torch.randn(1, 4, 64), kv.transpose(1, 2))  # not contiguous
    if isa != "generic":
        assert not paged.supports(torch.randn(1, 2, 12), torch.randn(2, 4, 4, 2, 12))  # 12 % 8
        assert not paged.supports(torch.randn(1, 2, 264), torch.randn(2, 4, 4, 2, 264))  # > 256
    with pytest.raises(ValueError, match="does not take"):
        paged(torch.randn(1, 4, 64).bfloat16(), kv, table, torch.tensor([3]), 0.1)
    with pytest.raises(ValueError, match="int64"):
        paged(torch.randn(1, 4, 64), kv, table.int(), torch.tensor([3]), 0.1)
    with pytest.raises(ValueError, match="int64"):
        paged(torch.randn(1, 4, 64), kv, table, torch.tensor([3, 3]), 0.1)
    with pytest.raises(ValueError, match=">= 1"):
        paged(torch.randn(1, 4, 64), kv, table, torch.tensor([0]), 0.1)
    assert paged(torch.empty(0, 4, 64), kv, table[:0], torch.empty(0, dtype=torch.int64), 0.1).shape == (0, 4, 64)



@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_reports_scratch_it_cannot_allocate(isa: str, threads: int) -> None:
    # a length of 2^44 keys asks for terabytes of key-range partials: the kernel must refuse before it reads a key
    # (the block table has one column) and leave the process alive; it used to call abort()
    paged = kernel_or_skip("paged_decode", isa)
    kv = torch.randn(2, 4, 4, 2, 64)
    with pytest.raises(MemoryError, match="scratch"):
        paged(torch.randn(1, 4, 64), kv, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1 << 44]), 0.1,
              num_threads=threads)
    out = paged(torch.randn(1, 4, 64), kv, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([3]), 0.1,
                num_threads=threads)  # and runs normally after
    assert torch.isfinite(out).all()

# ---------------------------------------------------------------- fused ops

def torch_add_rmsnorm(x, res, w, eps):
    """loom.model.layers.norm.RMSNorm's torch code: (normed, x + res)."""
    total = x + res if res is not None else x
    if x.dtype == torch.float32:
        return F.rms_norm(total, (x.shape[-1],), w, eps), total
    return w * F.rms_norm(total.float(), (x.shape[-1],), None, eps).to(x.dtype), total


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (70, 100), (2, 17), (4, 5), (1, 3000), (2, 9)])
def test_add_rmsnorm_matches_torch(isa: str, dtype: torch.dtype, rows: int, hidden: int) -> None:
    fused = kernel_or_skip("fused_ops", isa)
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    for residual in (res, None):
        out, total = fused.add_rmsnorm(x, residual, w, 1e-5)
        ref, ref_total = torch_add_rmsnorm(x, residual, w, 1e-5)
        assert out.dtype == dtype and out.shape == x.shape
        if residual is None:
            assert total is None
        else:
            assert torch.equal(total, ref_total)  # the residual sum rounds exactly like torch's add
        if TORCH_X86:  # the sum of squares added in torch's order: equal bit for bit
            assert torch.equal(out, ref)
        elif dtype == torch.float32:
            assert torch.all((out.double() - ref.double()).abs() <= 4 * f32_ulp(ref))
        else:
            assert torch.all((out.float() - ref.float()).abs() <= bf16_ulp(ref.float()) + 1e-6)


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 40), (65, 96), (3, 7), (2, 1000), (57, 3350)])
def test_silu_mul_matches_torch(isa: str, dtype: torch.dtype, rows: int, inter: int) -> None:
    """(57, 3350): torch splits the 190950 elements over its threads in the middle of row 28."""
    fused = kernel_or_skip("fused_ops", isa)
    g = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    old = torch.get_num_threads()
    try:
        for threads in {1, old}:
            torch.set_num_threads(threads)
            ref = F.silu(gate).mul_(up)
            out = fused.silu_mul(gate_up)
            assert out.dtype == dtype and out.shape == (rows, inter)
            if isa != "generic" and TORCH_X86:  # SLEEF's expf over torch's vector/scalar split: bit for bit
                assert torch.equal(out, ref)
            elif dtype == torch.float32:  # libm's expf against SLEEF's: within an ulp or two
                assert torch.all((out.double() - ref.double()).abs() <= 4 * f32_ulp(ref) + 1e-30)
            else:
                assert torch.all((out.float() - ref.float()).abs() <= bf16_ulp(ref.float()) + 1e-6)
                assert (out != ref).float().mean() < 0.02
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
def test_fused_ops_follow_torchs_16_lane_order_where_torch_runs_avx512(isa: str, monkeypatch) -> None:
    """The order of torch's AVX-512 kernels (16 float lanes; what `_lanes` is on such a CPU): checked against
    torch there; here, where torch's kernels are 8 lanes wide, within a few ulps."""
    fused = kernel_or_skip("fused_ops", isa)
    monkeypatch.setattr(fused, "_lanes", 16)
    g = torch.Generator().manual_seed(3)
    for rows, hidden in ((1, 576), (3, 1000), (2, 15), (1, 20000)):
        x = torch.randn(rows, hidden, generator=g) * 3
        w = torch.randn(hidden, generator=g)
        out, _ = fused.add_rmsnorm(x, None, w, 1e-5)
        ref = F.rms_norm(x, (hidden,), w, 1e-5)
        assert torch.all((out.double() - ref.double()).abs() <= 4 * f32_ulp(ref))
        gate_up = torch.randn(rows, 2 * hidden, generator=g) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        assert torch.all((fused.silu_mul(gate_up).double() - ref.double()).abs() <= 4 * f32_ulp(ref) + 1e-30)


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 32, 128, 6])
def test_rotary_equals_apply_rotary_bit_for_bit(isa: str, dtype: torch.dtype, dim: int) -> None:
    from loom.model.layers.rotary import RotaryEmbedding, apply_rotary

    fused = kernel_or_skip("fused_ops", isa)
    rope = RotaryEmbedding(dim, 256, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 200, 3])
    cos, sin = rope.cos_sin(positions)
    qkv = torch.randn(5, (9 + 3 + 3) * dim).to(dtype)
    x = qkv[:, : 12 * dim].view(5, 12, dim)  # strided rows, as in LlamaAttention
    out = fused.rotary(x, cos, sin)
    assert out is not None and out.dtype == dtype
    assert torch.equal(out, apply_rotary(x.contiguous(), cos, sin))


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
def test_fused_ops_decline_what_they_do_not_take(isa: str) -> None:
    fused = kernel_or_skip("fused_ops", isa)
    x = torch.randn(2, 8)
    assert fused.add_rmsnorm(x, None, torch.randn(8).bfloat16(), 1e-5) is None  # mixed dtypes
    assert fused.add_rmsnorm(x.half(), None, torch.randn(8).half(), 1e-5) is None  # float16
    assert fused.add_rmsnorm(x, None, torch.randn(7), 1e-5) is None  # weight shape
    assert fused.add_rmsnorm(x, torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-5) is None  # residual dtype
    assert fused.add_rmsnorm(torch.randn(8, 2).T, None, torch.randn(8), 1e-5) is None  # not contiguous
    assert fused.silu_mul(torch.randn(2, 7)) is None  # odd width
    assert fused.silu_mul(torch.randn(2, 8).half()) is None
    assert fused.rotary(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 1, 5)) is None  # odd dim
    assert fused.rotary(torch.randn(2, 3, 8), torch.randn(2, 1, 8).double(), torch.randn(2, 1, 8)) is None
    assert fused.rotary(torch.randn(2, 8, 3).transpose(1, 2), torch.randn(2, 1, 3), torch.randn(2, 1, 3)) is None
    assert fused.rotary(torch.randn(2, 3, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)) is None  # table rows
    out, total = fused.add_rmsnorm(torch.empty(0, 8), torch.empty(0, 8), torch.randn(8), 1e-5)
    assert out.shape == total.shape == (0, 8)


# ---------------------------------------------------------------- gemv with bf16 and float32 weights

# (kernel, weight dtype, ISA) for each ISA build of each GEMV this CPU runs
GEMVS = [(name, dtype, isa) for name, dtype in (("gemv_w16", torch.bfloat16), ("gemv_f32", torch.float32))
         for isa in kernel_isas(name)]


@pytest.mark.parametrize("name,dtype,isa", GEMVS)
@pytest.mark.parametrize("m", range(1, 10))
@pytest.mark.parametrize("n,k", [(1, 1), (3, 31), (4, 32), (5, 33), (577, 576), (130, 1536), (7, 100), (9, 47)])
def test_gemv_matches_float64_reference(name: str, dtype: torch.dtype, isa: str, m: int, n: int, k: int) -> None:
    gemv = kernel_or_skip(name, isa)
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    for b in (None, torch.randn(n, generator=g)):
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        y = gemv(x, w, b)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        # float32 sums of k products (each exact in an FMA, or rounded once): within (k + 1) eps32 sum|x w|
        bound = (k + 1) * 2.0 ** -23 * ((x.double().abs() @ w.double().abs().T)
                                        + (b.double().abs() if b is not None else 0))
        assert torch.all((y.double() - ref).abs() <= bound + 1e-30)


@pytest.mark.parametrize("name,dtype,isa", GEMVS)
def test_gemv_takes_strided_rows_and_the_thread_count(name: str, dtype: torch.dtype, isa: str) -> None:
    gemv = kernel_or_skip(name, isa)
    x = torch.randn(6, 200)[:, :150]  # row stride 200
    w = torch.randn(70, 150).to(dtype)
    ref = x.double() @ w.double().T
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.allclose(gemv(x, w).double(), ref, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------- gemv with fp8 (e4m3) weights

FP8_ISAS = kernel_isas("gemv_fp8")
# every e4m3 byte but the two NaNs (0x7F, 0xFF), which loom refuses at load
FP8_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def _fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] of every magnitude (any byte, subnormals and zeros included) and scales [n]."""
    w = FP8_BYTES[torch.randint(0, len(FP8_BYTES), (n, k), generator=g)].view(torch.float8_e4m3fn)
    return w, torch.rand(n, generator=g) * 0.01 + 1e-3


@pytest.mark.parametrize("isa", FP8_ISAS)
def test_fp8_dequantize_is_torchs_conversion_times_the_scale(isa: str) -> None:
    """Every non-NaN byte decodes to torch's float8_e4m3fn value (the OCP FP8 spec), and `dequantize` rounds each
    product with the row's scale once, as `w.float() * scale` does: the same bits, odd widths (tails) included."""
    gemv = kernel_or_skip("gemv_fp8", isa)
    every = FP8_BYTES.view(torch.float8_e4m3fn).reshape(1, -1)
    assert torch.equal(gemv.dequantize(every.contiguous(), torch.ones(1)), every.float())
    g = torch.Generator().manual_seed(1)
    for n, k in [(3, 31), (17, 577), (2, 16)]:
        w, s = _fp8(n, k, g)
        assert torch.equal(gemv.dequantize(w, s), w.float() * s[:, None])


@pytest.mark.parametrize("isa", FP8_ISAS)
@pytest.mark.parametrize("m", range(1, 10))
@pytest.mark.parametrize("n,k", [(1, 1), (3, 31), (4, 32), (5, 33), (577, 576), (130, 1536), (9, 47)])
def test_gemv_fp8_matches_float64_reference(isa: str, m: int, n: int, k: int) -> None:
    gemv = kernel_or_skip("gemv_fp8", isa)
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g)
    w, s = _fp8(n, k, g)
    wd = w.double() * s.double()[:, None]
    for b in (None, torch.randn(n, generator=g)):
        ref = x.double() @ wd.T + (b.double() if b is not None else 0)
        y = gemv(x, w, s, b)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        # float32 sums of k products, then one product with the scale and the bias: within (k + 3) eps32 sum|x w|
        bound = (k + 3) * 2.0 ** -23 * ((x.double().abs() @ wd.abs().T) + (b.double().abs() if b is not None else 0))
        assert torch.all((y.double() - ref).abs() <= bound + 1e-30)


@pytest.mark.parametrize("isa", FP8_ISAS)
def test_gemv_fp8_gives_a_row_the_same_bits_alone_in_any_batch_and_on_every_thread_count(isa: str) -> None:
    """One summation order per output (csrc/gemv_fp8.c): a row's result does not depend on the rows beside it (passes
    of 1, 2, 3 and 4 rows), its batch's size, strided rows or the thread count."""
    gemv = kernel_or_skip("gemv_fp8", isa)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(13, 600, generator=g)[:, :577]  # row stride 600
    w, s = _fp8(301, 577, g)
    b = torch.randn(301, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = gemv(x, w, s, b)
        torch.set_num_threads(1)
        for i in range(13):
            for rows in (1, 2, 3, 4):
                assert torch.equal(gemv(x[i : i + rows], w, s, b)[:1], batch[i : i + 1])
    finally:
        torch.set_num_threads(old)


def test_gemv_fp8_builds_with_vectors_give_the_same_bits() -> None:
    """The avx512_vnni build's 16-lane accumulators hold the AVX2 build's 32 partial sums and combine them in the
    same order (csrc/gemv_fp8.c): the two give the same bits."""
    vector = [isa for isa in FP8_ISAS if isa != "generic"]
    if len(vector) < 2:
        pytest.skip(f"this CPU runs {FP8_ISAS} of gemv_fp8: one vector build")
    g = torch.Generator().manual_seed(3)
    x, (w, s) = torch.randn(6, 1553, generator=g), _fp8(129, 1553, g)
    outs = [kernel_or_skip("gemv_fp8", isa)(x, w, s) for isa in vector]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("isa", FP8_ISAS)
def test_gemv_fp8_sums_in_gemv_f32s_order(isa: str) -> None:
    """With unit scales, gemv_fp8 gives gemv_f32's bits on the decoded weight (csrc/gemv_fp8.c: its values times
    2^-8, summed in the same fixed order, times 256 are the same float32 operations up to powers of two): the
    summation order is the one documented, in every build (the avx512_vnni one against gemv_f32's AVX2 build)."""
    gemv = kernel_or_skip("gemv_fp8", isa)
    f32 = kernel_or_skip("gemv_f32", "generic" if isa == "generic" else "avx2")
    g = torch.Generator().manual_seed(11)
    w, _ = _fp8(67, 1100, g)
    w = (w.float().clamp(-4, 4)).to(torch.float8_e4m3fn)  # products far from float32's subnormals
    x, b = torch.randn(9, 1100, generator=g), torch.randn(67, generator=g)
    assert torch.equal(gemv(x, w, torch.ones(67), b), f32(x, w.float(), b))


@pytest.mark.parametrize("isa", FP8_ISAS)
def test_gemv_fp8_refuses_what_it_cannot_read(isa: str) -> None:
    gemv = kernel_or_skip("gemv_fp8", isa)
    w, s = _fp8(4, 32, torch.Generator().manual_seed(0))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv(x, w.float(), s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv(x, w.t(), s)  # not contiguous
    with pytest.raises(ValueError, match="one per output channel"):
        gemv(x, w, s[:3])
    with pytest.raises(ValueError, match="do not multiply"):
        gemv(torch.randn(2, 31), w, s)
    with pytest.raises(ValueError, match="float32"):
        gemv(x.double(), w, s)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, s, torch.randn(5))
    with pytest.raises(ValueError, match="one per output channel"):
        gemv.dequantize(w, s.double())


@pytest.mark.parametrize("isa", kernel_isas("gemv_f32"))
def test_gemv_f32_gives_a_row_the_same_bits_alone_and_in_any_batch(isa: str) -> None:
    """One summation order per output (csrc/gemv_f32.c): a row's result does not depend on the rows beside it,
    their number (odd and even: passes of two rows and of one), or the thread count."""
    gemv = kernel_or_skip("gemv_f32", isa)
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(13, 577, generator=g), torch.randn(301, 577, generator=g), torch.randn(301, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = gemv(x, w, b)
        torch.set_num_threads(1)
        for i in range(13):
            assert torch.equal(gemv(x[i : i + 1], w, b), batch[i : i + 1])
            assert torch.equal(gemv(x[i : i + 2], w, b)[:1], batch[i : i + 1])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("name,dtype,isa", GEMVS)
def test_gemv_rejects_what_it_cannot_read(name: str, dtype: torch.dtype, isa: str) -> None:
    gemv = kernel_or_skip(name, isa)
    w = torch.randn(8, 16).to(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    words = f"float32 x and {str(dtype).removeprefix('torch.')} weight"
    with pytest.raises(ValueError, match="multiply"):
        gemv(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match=words):
        gemv(torch.randn(2, 16).bfloat16(), w)
    with pytest.raises(ValueError, match=words):
        gemv(torch.randn(2, 16), w.to(other))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(2, 16), torch.randn(16, 8).to(dtype).T)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.randn(2, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.randn(2, 16), w, torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="unit column stride"):
        gemv(torch.randn(16, 2).T, w)
    assert gemv(torch.empty(0, 16), w).shape == (0, 8)
    assert torch.equal(gemv(torch.empty(3, 0), torch.empty(4, 0, dtype=dtype), torch.ones(4)), torch.ones(3, 4))


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
def test_float16_conversion_rounds_as_torch(isa: str) -> None:
    """The float32 -> float16 rounding the C decode step applies to K/V rows of a float16 cache: nearest even,
    subnormals, overflow to infinity, NaN, bit for bit as torch's `.half()`."""
    fused = kernel_or_skip("fused_ops", isa)
    g = torch.Generator().manual_seed(3)
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e9, float("inf"), float("-inf"),
                            float("nan"), 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14 - 2.0 ** -26, 1e-30])
    x = torch.cat([
        halves, special,
        (halves[:-1] + halves[1:]) / 2,  # ties between neighbours: to even
        torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-28, 17, (100_000,), generator=g).float()),
    ])
    ours, theirs = fused.float16(x), x.half()
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), theirs[~nan].view(torch.int16))


@pytest.mark.parametrize("isa", kernel_isas("paged_decode"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 2, 40), (6, 3, 96)])
def test_paged_decode_reads_int8_kv_rows(isa: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    """int8 rows (codes, then float16 scales and minimums per 32 values, a short last group at head_dim 40 and
    96): the attention of their dequantization (kv_quant.dequantize_rows), over long and split contexts."""
    from loom.attention.kv_quant import dequantize_rows, kv_row_width, quantize_rows

    paged = kernel_or_skip("paged_decode", isa)
    if dim % paged.head_dim_multiple:
        pytest.skip(f"the {isa} build takes head_dim % {paged.head_dim_multiple} == 0")
    g = torch.Generator().manual_seed(dim + heads)
    block_size, num_blocks = 16, 80
    values = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g) * 3
    values[..., 5] += 20.0  # an outlier channel, as small models' K has
    kv_cache = quantize_rows(values, torch.int8)
    assert kv_cache.shape[-1] == kv_row_width(dim, torch.int8)
    seq_lens = torch.tensor([1, 17, 300, 900], dtype=torch.int64)
    block_table = torch.stack([torch.randperm(num_blocks, generator=g)[:57] for _ in seq_lens])
    q = torch.randn(len(seq_lens), heads, dim, generator=g).to(dtype)
    assert paged.supports(q, kv_cache)
    ref = reference_decode(q, dequantize_rows(kv_cache, torch.float64), block_table, seq_lens, dim ** -0.5, None)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for threads in (1, 2):
        out = paged(q, kv_cache, block_table, seq_lens, dim ** -0.5, None, num_threads=threads)
        assert torch.allclose(out.double(), ref, **tol), (threads, (out.double() - ref).abs().max())
        one = paged(q[2:3], kv_cache, block_table[2:3], seq_lens[2:3], dim ** -0.5, 100, num_threads=threads)
        ref_one = reference_decode(q[2:3], dequantize_rows(kv_cache, torch.float64), block_table[2:3],
                                   seq_lens[2:3], dim ** -0.5, 100)
        assert torch.allclose(one.double(), ref_one, **tol)
    assert not paged.supports(q, kv_cache[..., :-1])  # a row width that is not head_dim's


@pytest.mark.parametrize("isa", kernel_isas("fused_ops"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 2048), (3, 13), (65, 100)])
def test_gelu_tanh_mul_matches_a_float64_reference(isa: str, dtype: torch.dtype, rows: int, inter: int) -> None:
    """GeGLU's gelu_tanh(gate) * up against the definition in float64, 0.5 g (1 + tanh(u)) with u = sqrt(2/pi)
    (g + 0.044715 g^3), written g / (1 + e^(-2u)) (the same function; the tanh form cancels to 0 in the left
    tail even in float64): within float32's rounding of the exact product, over a range that reaches both tails;
    odd widths (a scalar tail) and more rows than the kernel's parallel threshold. Against torch's float32
    F.gelu(approximate="tanh"): within 1e-6 absolute (torch's tanh form flushes the left tail to 0)."""
    fused = kernel_or_skip("fused_ops", isa)
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    gelu = gate / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    out = fused.gelu_tanh_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, inter)
    if dtype == torch.float32:
        ref = gelu * up
        # relative 1e-5: in the left tail e^(-2u) turns the float32 rounding of 2u (|2u| up to ~88) into relative
        # error of the result, as it does for any float32 evaluation; the far tail underflows
        assert torch.all((out.double() - ref).abs() <= 1e-5 * ref.abs() + 8 * f32_ulp(ref.float()) + 1e-35)
        torch_ref = F.gelu(gate_up.chunk(2, dim=-1)[0], approximate="tanh") * gate_up.chunk(2, dim=-1)[1]
        assert torch.all((out.double() - torch_ref.double()).abs() <= 8 * f32_ulp(torch_ref) + 1e-6)
    else:  # gelu rounded to bf16, then the product rounded: one bf16 step of each at most
        ref = (gelu.to(torch.bfloat16).double() * up).float()
        assert torch.all((out.float() - ref).abs() <= 2 * bf16_ulp(ref) + 1e-6)
    assert fused.gelu_tanh_mul(torch.randn(2, 7)) is None  # odd width
