"""ctypes bindings of loom's float32 / bfloat16 CPU kernels for any CPU (csrc/paged_decode.c, fused_ops.c,
gemv_w16.c, gemv_f32.c, gemv_fp8.c), built per ISA as `avx2` (AVX2 + FMA: Haswell, Zen 1-3 and later) and
`generic` (portable C, ARM included); gemv_fp8 also as `avx512_vnni` (its 512-bit variant).

They are listed, built and dispatched by loom/kernels/registry.py (`get_kernel("paged_decode")` and so on);
this module only wraps a loaded library. Each binding checks what it is given, since the C code reads raw
pointers, and records the ISA it was built for in `self.isa`.
"""

from __future__ import annotations

import ctypes

import torch

from loom.attention.kv_quant import kv_row_width

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' is_bf16 flag
# paged_decode's kv_type: cache elements (int8: loom's rows of codes + float16 group scales and minimums)
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


def _torch_lanes() -> int:
    """Floats in torch's Vectorized<float> on this CPU (16 on its AVX-512 kernels, else 8): the vector/scalar
    split of its elementwise loops, which fused_ops.c reproduces (its sum kernel is 8 lanes everywhere)."""
    return 16 if torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512") else 8


_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: torch's elementwise loops below this run on one thread


def _torch_chunk(numel: int) -> int:
    """Elements per thread of torch's at::parallel_for over `numel` elements of an elementwise op (0: one
    thread): where its vectorized loops restart, which fused_ops.c follows to round like torch."""
    if numel < _GRAIN_SIZE:
        return 0
    threads = min(torch.get_num_threads(), -(-numel // _GRAIN_SIZE))
    return 0 if threads <= 1 else -(-numel // threads)


def check_decode_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int, lengths_checked: bool) -> None:
    """The paged decode kernels' table checks: block_table int64 [B, max_blocks] with unit column stride and
    seq_lens int64 [B], CPU tensors, every seq_len >= 1 (unless the caller already checked).

    Raises:
        ValueError: any of those does not hold.
    """
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or seq_lens.shape != (batch,) \
            or block_table.dim() != 2 or block_table.shape[0] != batch or block_table.stride(1) != 1 \
            or not block_table.is_cpu or not seq_lens.is_cpu:
        raise ValueError("block_table [B, max_blocks] and seq_lens [B] must be int64 CPU tensors, the table "
                         "with unit column stride")
    if batch and not lengths_checked and int(seq_lens.min()) < 1:
        raise ValueError("every seq_len must be >= 1")


class PagedDecode:
    """ctypes binding of `loom_paged_decode` (csrc/paged_decode.c): one-token attention of a batch over its own
    blocks of a float32, bfloat16 or float16 paged KV cache, read in place (no gather, no padding, online softmax).

    Query float32 over a float32, bfloat16, float16 or int8 cache, or query bfloat16 over a 16-bit or int8 cache
    (16-bit cache rows widened in registers, int8 rows of loom/attention/kv_quant.py dequantized once per tile);
    any number of query heads per KV head. Threads take whole requests (all KV heads, so that
    each reads its blocks sequentially); with fewer than 4 requests per thread and long contexts, key ranges of
    a request, merged afterwards (see the top of csrc/paged_decode.c)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        fn = lib.loom_paged_decode
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5
                       + [ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int])
        fn.restype = ctypes.c_int
        self._fn = fn
        self.isa = isa
        # the AVX2 build's vector path: head_dim % 8 == 0, up to 256; the portable build takes any head_dim
        self.head_dim_multiple = 1 if isa == "generic" else 8
        self.max_head_dim: int | None = None if isa == "generic" else 256

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """True when this kernel can serve query [B, H, D] over kv_cache [2, num_blocks, block_size, H_kv, D]:
        query float32 or bfloat16, the cache float32 (float32 queries only), bfloat16, float16 or int8 rows
        (kv_quant's layout: head_dim codes, then float16 scales and minimums per 32), on the CPU, contiguous."""
        if query.dtype not in _DTYPES or kv_cache.dtype not in _KV_TYPES:
            return False
        if kv_cache.dtype == torch.float32 and query.dtype != torch.float32:
            return False
        if not query.is_cpu or not kv_cache.is_cpu:
            return False
        if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
            return False
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = kv_cache.shape[3]
        row = kv_row_width(head_dim, kv_cache.dtype)  # int8 rows carry their scales
        if head_dim < 1 or kv_heads < 1 or kv_cache.shape[4] != row or heads % kv_heads:
            return False
        if head_dim % self.head_dim_multiple or (self.max_head_dim is not None and head_dim > self.max_head_dim):
            return False
        return True

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 num_threads: int | None = None, lengths_checked: bool = False) -> torch.Tensor:
        """query [B, H, D] float32 or bfloat16; kv_cache [2, num_blocks, block_size, H_kv, D] float32, bfloat16
        or float16, or [.., H_kv, row] int8 rows (K then V; see `supports`); block_table [B, >= ceil(max seq_len / block_size)] int64 block ids; seq_lens [B] int64 keys
        per request (>= 1, the query's own key written); scale: softmax scale; sliding_window: keys each query
        may see, itself included (None = all). Returns [B, H, D] in the query's dtype (bfloat16 rounded to
        nearest even from float32 arithmetic).

        Block ids and lengths are trusted as the engine's own bookkeeping: they are not range-checked per key.
        `lengths_checked=True` skips the seq_lens >= 1 check (a reduction) for callers that know it holds.

        Raises:
            ValueError: shapes or dtypes the kernel does not take (see `supports`), or a seq_len < 1.
            MemoryError: the kernel's scratch (a few KiB per thread, plus the key-range partials) could not be
                allocated.
        """
        if not self.supports(query, kv_cache):
            raise ValueError(f"paged_decode ({self.isa}) does not take query {tuple(query.shape)} {query.dtype} "
                             f"over kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
        batch, heads, head_dim = query.shape
        check_decode_tables(block_table, seq_lens, batch, lengths_checked)
        query = query.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)
        if batch and self._fn(query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                              block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                              batch, heads, kv_cache.shape[3], head_dim, kv_cache.shape[2], scale, sliding_window or 0,
                              num_threads or torch.get_num_threads(), _DTYPES[query.dtype],
                              _KV_TYPES[kv_cache.dtype]):
            raise MemoryError("loom_paged_decode could not allocate its scratch memory")
        return out


class FusedOps:
    """ctypes bindings of csrc/fused_ops.c: add+RMSNorm, SiLU*up and rotary for float32 or bfloat16 CPU tensors
    (every tensor of a call in one dtype; the rotary tables float32).

    Float32 results equal torch's bit for bit for the residual
    add, RMSNorm and rotary, and SiLU on the avx2 build (within an ulp on the generic one, which calls libm's
    expf); bfloat16 rounds where torch's bf16 ops round. Each method returns None when its inputs are not what
    the kernel takes (dtype, device, layout, shape), so callers keep their torch code for everything else.
    """

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self._norm = lib.loom_add_rmsnorm
        self._norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int]
        self._norm.restype = None
        self._silu = lib.loom_silu_mul
        self._silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_int64]
        self._silu.restype = None
        self._gelu = lib.loom_gelu_tanh_mul
        self._gelu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._gelu.restype = None
        self._rope = lib.loom_rotary
        self._rope.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                               + [ctypes.c_int])
        self._rope.restype = None
        self._to_f16 = lib.loom_f32_to_f16_n
        self._to_f16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._to_f16.restype = None
        self.isa = isa
        self._lanes = _torch_lanes()

    def float16(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 (any shape, CPU) -> float16 of its shape, rounded to nearest even by the C conversion the
        decode step uses for float16 KV caches (for tests: it must equal torch's `.half()`, bit for bit).

        Raises:
            ValueError: x not a float32 CPU tensor.
        """
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError("float16 takes a float32 CPU tensor")
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.float16)
        self._to_f16(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    # (the checks are spelled out, not looped, for speed: at one decode row per step a call's Python side, not its
    # arithmetic, is its cost)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """x [M, H] (+ residual [M, H]) -> (RMSNorm(s) * weight, s) with s = x + residual (s is None without a
        residual); every tensor float32, or every tensor bfloat16 (s rounded to bf16, then
        bf16(weight * bf16(RMSNorm(s))) as loom's RMSNorm computes bf16), weight [H]. None when not applicable.
        """
        dtype = x.dtype
        flag = _DTYPES.get(dtype)
        if flag is None or x.dim() != 2 or weight.dtype != dtype or weight.dim() != 1 or not x.is_cpu \
                or not weight.is_cpu or not x.is_contiguous() or not weight.is_contiguous():
            return None
        m, h = x.shape
        if weight.shape[0] != h:
            return None
        if residual is not None and (residual.dtype != dtype or not residual.is_cpu or residual.shape != x.shape
                                     or not residual.is_contiguous()):
            return None
        out = torch.empty(m, h, dtype=dtype)
        total = torch.empty(m, h, dtype=dtype) if residual is not None else None
        if m and h:
            self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), None if total is None else total.data_ptr(), m, h, eps, flag)
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [M, 2I] float32 or bfloat16 -> silu(gate) * up [M, I] of its dtype (bf16: silu rounded to
        bf16, then the product rounded, as torch's bf16 ops). None when not applicable."""
        dtype = gate_up.dtype
        flag = _DTYPES.get(dtype)
        if flag is None or gate_up.dim() != 2 or not gate_up.is_cpu or not gate_up.is_contiguous():
            return None
        m, width = gate_up.shape
        if width % 2:
            return None
        inter = width // 2
        out = torch.empty(m, inter, dtype=dtype)
        if m and inter:
            self._silu(gate_up.data_ptr(), out.data_ptr(), m, inter, flag, self._lanes, _torch_chunk(m * inter))
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [M, 2I] float32 or bfloat16 -> gelu_tanh(gate) * up [M, I] of its dtype (GeGLU: Gemma's MLP;
        gelu_tanh = F.gelu(approximate="tanh") within a few ulp; bf16: gelu rounded to bf16, then the product
        rounded). None when not applicable."""
        dtype = gate_up.dtype
        flag = _DTYPES.get(dtype)
        if flag is None or gate_up.dim() != 2 or not gate_up.is_cpu or not gate_up.is_contiguous() \
                or gate_up.shape[1] % 2:
            return None
        m, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, inter, dtype=dtype)
        if m and inter:
            self._gelu(gate_up.data_ptr(), out.data_ptr(), m, inter, flag)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
        """x [n, heads, dim] float32 or bfloat16 (heads and dim contiguous; tokens may be strided, e.g. a view of
        the fused qkv output), cos / signed_sin [n, 1, dim] float32 contiguous, dim even -> rotated
        [n, heads, dim] of x's dtype, bit for bit equal to apply_rotary's torch code. None when not applicable."""
        dtype = x.dtype
        flag = _DTYPES.get(dtype)
        if flag is None or x.dim() != 3 or not x.is_cpu:
            return None
        n, heads, dim = x.shape
        token_stride, head_stride, col_stride = x.stride()
        if dim % 2 or col_stride != 1 or (heads > 1 and head_stride != dim) or cos.shape != (n, 1, dim) \
                or signed_sin.shape != (n, 1, dim):
            return None
        if cos.dtype != torch.float32 or signed_sin.dtype != torch.float32 or not cos.is_cpu \
                or not signed_sin.is_cpu or not cos.is_contiguous() or not signed_sin.is_contiguous():
            return None
        out = torch.empty(n, heads, dim, dtype=dtype)
        if n and heads and dim:
            self._rope(x.data_ptr(), token_stride, cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), n, heads,
                       dim, flag)
        return out


def _gemv_rows(name: str, weight: str, x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None) -> tuple[int, int]:
    """Check what the `loom_gemv_*` kernel `name` (of `weight` weights) reads of x [M, k] (float32 CPU, unit column
    stride) and bias ([n] float32 contiguous CPU, or None); returns (M, x's row stride).

    Raises:
        ValueError: naming what does not fit (the kernels read raw pointers, so nothing unchecked reaches them).
    """
    # (checks ordered and spelled for speed: this runs once per linear layer per decode step)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and a weight of {n} x {k} do not multiply as x W^T")
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"{name} takes float32 x and {weight} weight, CPU tensors; got x {x.dtype} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1 or bias.shape[0] != n
                             or not bias.is_contiguous() or not bias.is_cpu):
        raise ValueError(f"bias must be a contiguous float32 CPU tensor [{n}]")
    x_stride, col_stride = x.stride()
    if col_stride != 1 and k > 1:
        raise ValueError("x must have unit column stride")
    return x.shape[0], x_stride


class _Gemv:
    """ctypes binding of a `loom_gemv_*` kernel: y = x W^T (+ b) for a few float32 rows of x over a weight of
    `weight_dtype` (float32 sums)."""

    symbol: str
    weight_dtype: torch.dtype

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        fn = getattr(lib, self.symbol)
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                       + [ctypes.c_int])
        fn.restype = ctypes.c_int  # 0, or -1 when its scratch could not be allocated
        self._fn = fn
        self.isa = isa

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 (unit column stride; rows may be strided), weight [N, K] of `weight_dtype`
        contiguous, bias [N] float32 or None -> [M, N] float32. Any M (the kernels are for a few decode rows).

        Raises:
            ValueError: wrong dtype, device, layout or shape (the kernel reads raw pointers, so nothing unchecked
                reaches it).
            MemoryError: the kernel could not allocate its scratch memory.
        """
        name, dtype = self.symbol.removeprefix("loom_"), str(self.weight_dtype).removeprefix("torch.")
        if weight.dim() != 2:
            raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as x W^T")
        if weight.dtype != self.weight_dtype or not weight.is_cpu:
            raise ValueError(f"{name} takes float32 x and {dtype} weight, CPU tensors; got weight {weight.dtype}")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous")
        n, k = weight.shape
        m, x_stride = _gemv_rows(name, dtype, x, k, n, bias)
        y = torch.empty(m, n, dtype=torch.float32)
        if m and n and self._fn(x.data_ptr(), x_stride, weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), m, n, k, torch.get_num_threads()):
            raise MemoryError(f"{self.symbol.removeprefix('loom_')} could not allocate its scratch memory")
        return y


class GemvW16(_Gemv):
    """`loom_gemv_w16` (csrc/gemv_w16.c): bfloat16 weights widened in registers, float32 sums: half the weight
    bytes of float32 at decode."""

    symbol = "loom_gemv_w16"
    weight_dtype = torch.bfloat16


class GemvF32(_Gemv):
    """`loom_gemv_f32` (csrc/gemv_f32.c): float32 weights read once at the memory's rate, and one summation order
    per output whatever the rows of x (a row's bits do not depend on its batch)."""

    symbol = "loom_gemv_f32"
    weight_dtype = torch.float32


class GemvFp8:
    """ctypes binding of `loom_gemv_fp8` and `loom_dequant_fp8` (csrc/gemv_fp8.c): FP8 e4m3 weights with a float32
    scale per output channel, decoded in registers, float32 sums (a quarter of float32's weight bytes at decode,
    one summation order per output whatever the rows of x)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        fn = lib.loom_gemv_fp8
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
                       + [ctypes.c_int])
        fn.restype = ctypes.c_int
        self._gemv = fn
        fn = lib.loom_dequant_fp8
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._dequant = fn
        self.isa = isa

    @staticmethod
    def _check_weight(weight: torch.Tensor, scale: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or not weight.is_cpu or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous float8_e4m3fn CPU tensor [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        n = weight.shape[0]
        if scale.dtype != torch.float32 or not scale.is_cpu or not scale.is_contiguous() or scale.numel() != n:
            raise ValueError(f"scale must be a contiguous float32 CPU tensor of {n} values (one per output channel)")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] float32 = (x e4m3(W)^T) * scale (+ bias): x [M, K] float32 (unit column stride; rows may be
        strided), weight [N, K] float8_e4m3fn contiguous (no NaN bytes: they are not decoded as NaN), scale [N]
        (or [N, 1]) float32, bias [N] float32 or None. Any M (the kernel is for a few decode rows).

        Raises:
            ValueError: wrong dtype, device, layout or shape (the kernel reads raw pointers).
        """
        self._check_weight(weight, scale)
        n, k = weight.shape
        m, x_stride = _gemv_rows("gemv_fp8", "float8_e4m3fn", x, k, n, bias)
        y = torch.empty(m, n, dtype=torch.float32)
        if m and n:
            self._gemv(x.data_ptr(), x_stride, weight.data_ptr(), scale.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] float32 = e4m3(weight) * scale per row, each product rounded once: `weight.float() * scale`
        bit for bit, without its [N, K] float32 temporary; written into `out` (a contiguous float32 CPU tensor of
        N * K values, returned as [N, K]) when given.

        Raises:
            ValueError: as __call__, or an `out` that is not such a tensor.
        """
        self._check_weight(weight, scale)
        if out is None:
            out = torch.empty(weight.shape, dtype=torch.float32)
        elif out.dtype != torch.float32 or not out.is_cpu or not out.is_contiguous() or out.numel() != weight.numel():
            raise ValueError(f"out must be a contiguous float32 CPU tensor of {weight.numel()} values")
        out = out.view(weight.shape)
        if out.numel():
            self._dequant(weight.data_ptr(), scale.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1],
                          torch.get_num_threads())
        return out


class TokenBitmask:
    """ctypes binding of csrc/token_bitmask.c: a grammar's token bitmask applied to float32 CPU logits in place
    (the sampler's structured-output step; torch's masked_fill took ~1.7 ms for 16 rows of 49k tokens)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self._apply = lib.loom_apply_token_bitmask
        self._apply.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_int64]
        self._apply.restype = None
        self.isa = isa

    def apply(self, logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> bool:
        """logits [N, V] float32 CPU with unit column stride; masks int32 [len(rows), words] contiguous CPU.
        Returns False (nothing done) when the tensors are not what the kernel takes."""
        if logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2 or logits.stride(1) != 1 \
                or masks.dtype != torch.int32 or not masks.is_cpu or not masks.is_contiguous() \
                or masks.shape[0] != len(rows):
            return False
        index = torch.tensor(rows, dtype=torch.int64)
        self._apply(logits.data_ptr(), logits.stride(0), masks.data_ptr(), index.data_ptr(), len(rows),
                    logits.shape[1], masks.shape[1])
        return True
