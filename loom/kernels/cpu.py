"""ctypes binding of loom's bfloat16-weight GEMV for CPUs with AVX512-BF16 (csrc/gemv_bf16.c).

They are listed, built and dispatched by loom/kernels/registry.py (`get_kernel("gemv_bf16")` and so on); this
module only wraps a loaded library. Each binding checks what it is given, since the C code reads raw pointers.
"""

from __future__ import annotations

import ctypes

import torch

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
