"""ctypes bindings of loom's bfloat16 CPU kernels (csrc/gemv_bf16.c, paged_decode_bf16.c, fused_bf16.c).

They are listed, built and dispatched by loom/kernels/registry.py (`get_kernel("gemv_bf16")` and so on); this
module only wraps a loaded library. Each binding checks what it is given, since the C code reads raw pointers.
"""

from __future__ import annotations

import ctypes

import torch

from loom.kernels.cpu_generic import check_decode_tables

# Most rows of x the GEMV kernel takes. Above this a step is no longer weight-bandwidth-bound and oneDNN's
# blocked GEMM is faster (benchmarks/NOTES.md, "Third pass").
GEMV_MAX_ROWS = 4


class GemvBf16:
    """ctypes binding of `loom_gemv_bf16` (csrc/gemv_bf16.c): y = x W^T (+ b) for a few rows of x."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.loom_gemv_bf16
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] bfloat16, weight [N, K] bfloat16 (contiguous), bias [N] bfloat16 or None ->
        [M, N] in `out_dtype` (bfloat16, rounded to nearest even, or float32). Float32 accumulation.

        Raises:
            ValueError: wrong dtype, device, layout or shape (the kernel reads raw pointers, so nothing
                unchecked reaches it).
        """
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as x W^T")
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu" \
                or weight.device.type != "cpu":
            raise ValueError("gemv_bf16 takes bfloat16 CPU tensors")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (weight.shape[0],)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous bfloat16 [{weight.shape[0]}]")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
        x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=out_dtype)
        if m and n:
            self._fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     m, n, k, int(out_dtype == torch.float32), torch.get_num_threads())
        return y


class PagedDecodeBf16:
    """ctypes binding of `loom_paged_decode_bf16` (csrc/paged_decode_bf16.c): one-token attention of a batch
    over its own blocks of a bfloat16 paged KV cache, read in place (no gather)."""

    MAX_HEAD_DIM = 256  # the kernel's register tiles
    MAX_GROUP = 16  # query heads per KV head

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.loom_paged_decode_bf16
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5
                       + [ctypes.c_float, ctypes.c_int64, ctypes.c_int])
        fn.restype = None
        self._fn = fn

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """True when this kernel can serve query [B, H, D] over kv_cache [2, num_blocks, block_size, H_kv, D]."""
        if query.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or query.device.type != "cpu":
            return False
        if query.dim() != 3 or kv_cache.dim() != 5 or not kv_cache.is_contiguous():
            return False
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = kv_cache.shape[3]
        return (kv_cache.shape[4] == head_dim and head_dim % 32 == 0 and head_dim <= self.MAX_HEAD_DIM
                and heads % kv_heads == 0 and heads // kv_heads <= self.MAX_GROUP)

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 num_threads: int | None = None, lengths_checked: bool = False) -> torch.Tensor:
        """query [B, H, D] bfloat16; kv_cache [2, num_blocks, block_size, H_kv, D] bfloat16 (K then V);
        block_table [B, >= ceil(max seq_len / block_size)] int64 block ids; seq_lens [B] int64 keys per
        request (>= 1, the query's own key written); scale: softmax scale; sliding_window: keys each query may
        see, itself included (None = all). Returns [B, H, D] bfloat16.

        Block ids and lengths are trusted as the engine's own bookkeeping: they are not range-checked per key.
        `lengths_checked=True` skips the seq_lens >= 1 check (a reduction) for callers that know it holds, such
        as the backend, which calls this once per layer with the same per-step plan.

        Raises:
            ValueError: shapes or dtypes the kernel does not take (see `supports`), or a seq_len < 1.
        """
        if not self.supports(query, kv_cache):
            raise ValueError(f"paged_decode_bf16 does not take query {tuple(query.shape)} {query.dtype} over "
                             f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
        batch, heads, head_dim = query.shape
        check_decode_tables(block_table, seq_lens, batch, lengths_checked)
        query = query.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)
        if batch:
            self._fn(query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
                     block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), batch, heads, kv_cache.shape[3],
                     head_dim, kv_cache.shape[2], scale, sliding_window or 0,
                     num_threads or torch.get_num_threads())
        return out


class FusedBf16:
    """ctypes bindings of csrc/fused_bf16.c: add+RMSNorm, SiLU*up and rotary for bfloat16 CPU tensors.

    Each method returns None when its inputs are not what the kernel takes (dtype, device, layout, shape), so
    callers keep their torch code for everything else.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.loom_add_rmsnorm_bf16
        self._norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        self._norm.restype = None
        self._silu = lib.loom_silu_mul_bf16
        self._silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        self._silu.restype = None
        self._rope = lib.loom_rotary_bf16
        self._rope.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                               + [ctypes.c_int64] * 3)
        self._rope.restype = None

    @staticmethod
    def _takes(*tensors: torch.Tensor) -> bool:
        return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """x [M, H] (+ residual [M, H]) -> (weight * RMSNorm(s), s) with s = x + residual rounded to bf16
        (s is None without a residual); every tensor bfloat16, weight [H]. None when not applicable."""
        if x.dim() != 2 or not self._takes(x, weight) or weight.shape != (x.shape[1],):
            return None
        if residual is not None and (residual.shape != x.shape or not self._takes(residual)):
            return None
        out = torch.empty_like(x)
        total = torch.empty_like(x) if residual is not None else None
        self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), None if total is None else total.data_ptr(), x.shape[0], x.shape[1], eps)
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [M, 2I] bfloat16 -> silu(gate) * up [M, I] bfloat16. None when not applicable."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not self._takes(gate_up):
            return None
        inter = gate_up.shape[1] // 2
        out = torch.empty(gate_up.shape[0], inter, dtype=torch.bfloat16)
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
        """x [n, heads, dim] bfloat16 (heads and dim contiguous; tokens may be strided, e.g. a view of the fused
        qkv output), cos / signed_sin [n, 1, dim] float32 contiguous -> rotated [n, heads, dim] bfloat16,
        bit for bit equal to apply_rotary's torch code. None when not applicable."""
        if x.dim() != 3 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return None
        n, heads, dim = x.shape
        if dim % 32 or x.stride(2) != 1 or x.stride(1) != dim or cos.shape != (n, 1, dim) \
                or signed_sin.shape != (n, 1, dim):
            return None
        if cos.dtype != torch.float32 or signed_sin.dtype != torch.float32 or not cos.is_contiguous() \
                or not signed_sin.is_contiguous():
            return None
        out = torch.empty(n, heads, dim, dtype=torch.bfloat16)
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), n, heads, dim)
        return out
