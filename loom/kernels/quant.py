"""ctypes binding of loom's quantized-weight CPU kernels (csrc/qgemm.c) for the packed layouts of
loom/quant/layout.py.

Listed, built and dispatched by loom/kernels/registry.py (`get_kernel("qgemm")`, one build per ISA:
avx512_vnni, avx2, generic); loom/quant/torch_kernels.py is the same interface in plain torch (any device)
and the reference the tests hold this one to. The exact definitions of what each function computes are in
qgemm.c's header comment. Every method checks what it is given, since the C code reads raw pointers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from loom.quant.layout import INTERLEAVED, Q4_LAYOUTS, PackedWeight, deinterleave_rows16

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class QuantizedActivations:
    """Activations x [M, K] quantized to int8 per block of 32 values of k (`quantize_activations`)."""

    xq: torch.Tensor  # int8 [M, K]: codes round(x / s) in -127..127 (never -128)
    xs: torch.Tensor  # float32 [M, K // 32]: s = max|x| / 127 of each block (per token: the row's s repeated)
    xsum: torch.Tensor  # float32 [M, K // 32]: float sum of the original x of each block (the mins' term)

    @property
    def shape(self) -> tuple[int, int]:
        """(M, K) of the activations."""
        return tuple(self.xq.shape)  # type: ignore[return-value]


def check_activations(xa: QuantizedActivations) -> tuple[int, int]:
    """(M, K) of `xa` after checking its fields' dtypes and shapes (any device: the torch kernels share it;
    QuantKernels also checks that they are contiguous CPU tensors).

    Raises:
        ValueError: a field of the wrong dtype or shape, or K not a multiple of 32.
    """
    xq = xa.xq
    if xq.dtype != torch.int8 or xq.dim() != 2:
        raise ValueError("QuantizedActivations.xq must be int8 [M, K]")
    m, k = xq.shape
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    want = (m, k // 32)
    for name, t in (("xs", xa.xs), ("xsum", xa.xsum)):
        if t.dtype != torch.float32 or t.shape != want:
            raise ValueError(f"QuantizedActivations.{name} must be float32 [{m}, {k // 32}]")
    return m, k


def _check_weight(w: PackedWeight, k: int) -> int:
    """N of `w` after checking what the C code relies on to stay in bounds (PackedWeight checked it when
    built, but its fields can be replaced since), including its K against the activations' `k`."""
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
    qw, sc, mn, g = w.qweight, w.scales, w.mins, w.group_size
    if not isinstance(g, int) or isinstance(g, bool) or not isinstance(qw, torch.Tensor) or qw.dim() != 2:
        raise ValueError(f"weight group_size must be an int and qweight a 2-D tensor, got {g!r}")
    n, cols = qw.shape
    if w.layout in Q4_LAYOUTS:
        wk = 2 * cols
        if qw.dtype != torch.uint8 or g % 32 or not 0 < g <= wk or wk % g or (w.layout == "q4gr16" and n % 16):
            raise ValueError(f"{w.layout} weight must have uint8 qweight and groups of a multiple of 32 dividing K "
                             f"(and q4gr16 N % 16 == 0), got group_size {g}")
    else:
        wk = cols
        if w.layout == "q8gr16" and (g not in (16, 32) or n % 16):
            raise ValueError("q8gr16 weight must have groups of 16 or 32 and N % 16 == 0")
        if w.layout not in ("q8g", "q8gr16") or qw.dtype != torch.int8 or not (g == 16 or (g % 32 == 0 and 0 < g <= wk)) or wk % g:
            raise ValueError(f"unsupported weight: layout {w.layout!r}, qweight {qw.dtype}, group_size {g}")
    if wk != k or k % 32:
        raise ValueError(f"activations have K={k} but the weight is [{n}, {wk}] (K must be a multiple of 32)")
    if not (qw.is_cpu and qw.is_contiguous()):
        raise ValueError("weight qweight must be a contiguous CPU tensor")
    want = (n, wk // g)
    for name, t in (("scales", sc), ("mins", mn)):
        if t is not None and (t.dtype != torch.float16 or t.shape != want or not t.is_contiguous() or not t.is_cpu):
            raise ValueError(f"weight {name} must be a contiguous float16 CPU tensor [{n}, {wk // g}]")
    return n


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
                             or not bias.is_cpu):
        raise ValueError(f"bias must be a contiguous float32 CPU tensor [{n}] or None")


def _check_out(out_dtype: torch.dtype) -> None:
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")


def _check_x(x: torch.Tensor) -> tuple[int, int, int]:
    """(M, K, row stride) of a float activation matrix the C code can read in place."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [M, K]")
    if x.dtype not in _FLOAT_DTYPES or not x.is_cpu:
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    if k > 1 and x.stride(1) != 1:
        raise ValueError("x must have unit column stride (any row stride)")
    return m, k, x.stride(0) if m > 1 else k


class QuantKernels:
    """ctypes bindings of csrc/qgemm.c for one ISA build (`isa`: "avx512_vnni", "avx2" or "generic")."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        impl = lib.loom_qgemm_impl
        impl.argtypes, impl.restype = [], ctypes.c_char_p
        self.impl = impl().decode()  # the code the build holds: "avx512_vnni", "avx2" or "scalar"
        self._quant = self._fn(lib.loom_quantize_act, [p, i64, i32, i64, i64, i32, p, p, p, i32], None)
        self._q4_q8 = self._fn(lib.loom_gemm_q4g_q8, [p, p, p, i64, i64, p, p, p, i64, p, p, i64, i32, i32], i32)
        self._q8_q8 = self._fn(lib.loom_gemm_q8g_q8, [p, p, p, i64, i64, p, p, p, i64, p, p, i64, i32, i32], i32)
        self._quant16 = self._fn(lib.loom_quantize_act16, [p, i64, i32, i64, i64, p, p, p, i32], None)
        self._q4_f = self._fn(lib.loom_gemm_q4g_f, [p, i64, i32, i64, i64, p, p, p, i64, p, p, i64, i32, i32], i32)
        self._q4r16_f = self._fn(lib.loom_gemm_q4gr16_f, [p, i64, i32, i64, i64, p, p, p, i64, p, p, i64, i32, i32],
                                 i32)
        self._q8r16_f = self._fn(lib.loom_gemm_q8gr16_f, [p, i64, i32, i64, i64, p, p, p, i64, p, p, i64, i32, i32],
                                 i32)
        self._q8_f = self._fn(lib.loom_gemm_q8g_f, [p, i64, i32, i64, i64, p, p, p, i64, p, p, i64, i32, i32], i32)
        self._dq4 = self._fn(lib.loom_dequant_q4g, [p, p, p, i64, i64, i64, p, i32, i32], None)
        self._dq8 = self._fn(lib.loom_dequant_q8g, [p, p, p, i64, i64, i64, p, i32, i32], None)
        self._dq_rows = self._fn(lib.loom_dequant_rows, [i32, i32, p, p, p, i64, i64, i64, p, i64, p, i32, i32], i32)
        self._rotate = self._fn(lib.loom_rotate_rows, [p, i64, i64, i64, i64, p, i32], None)
        self._q8c = self._fn(lib.loom_gemm_q8c_q8t, [p, p, i64, i64, i64, p, p, p, p, i64, i32, i32], None)
        self._nx16_min = self._fn(lib.loom_set_nx16_min_rows, [i64], i64)
        # rows from which gemm_f of q4g runs the 16-row groups, faster there than dequantization + torch's
        # float32 GEMM (benchmarks/NOTES.md, "q4g32 at many rows"); None in builds without them
        default = self._nx16_min(1 << 40)
        if default >= 0:
            self._nx16_min(default)
        self.row_group_min_rows: int | None = int(default) if default >= 0 else None
        # layouts this build's gemm_f runs fastest: q4gr16, whose 16-row groups run at every row count (one
        # summation order for any batch; PackedLinearMethod interleaves q4g weights at load where listed). Every
        # build reads q4gr16 with the same bits, the others a lane at a time (tests force them on any CPU).
        self.interleaved_layouts: tuple[str, ...] = ("q4gr16", "q8gr16") if default >= 0 else ()

    def set_row_group_min_rows(self, rows: int) -> int:
        """Sets the row count from which q4g's gemm_f runs the 16-row groups (qgemm.c, gemm16_q4_nx16;
        avx512_vnni builds); returns the previous value, or -1 in builds without them (nothing changes).
        Tests force the groups at any M with it; `row_group_min_rows` keeps the default."""
        return int(self._nx16_min(int(rows)))

    @staticmethod
    def _fn(fn: Any, argtypes: list[Any], restype: Any) -> Any:
        fn.argtypes, fn.restype = argtypes, restype
        return fn

    def quantize_activations(self, x: torch.Tensor, per_token: bool = False) -> QuantizedActivations:
        """x [M, K] float32 or bfloat16 (CPU, unit column stride, any row stride; K % 32 == 0) -> int8 codes
        per block of 32 (per_token: one scale per row, repeated in every block of xs).

        Raises:
            ValueError: x not a 2-D float32 / bfloat16 CPU matrix with unit column stride, or K % 32 != 0.
        """
        m, k, ldx = _check_x(x)
        xq = torch.empty(m, k, dtype=torch.int8)
        xs = torch.empty(m, k // 32, dtype=torch.float32)
        xsum = torch.empty(m, k // 32, dtype=torch.float32)
        if m and k:
            self._quant(x.data_ptr(), ldx, int(x.dtype == torch.bfloat16), m, k, int(per_token), xq.data_ptr(),
                        xs.data_ptr(), xsum.data_ptr(), torch.get_num_threads())
        return QuantizedActivations(xq, xs, xsum)

    def rotate_input(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x [M, K] -> loom.quant.hadamard.rotate_input(x, block) (the same values; a block Hadamard rotation
        before int8 quantization), in C for float32 CPU x with unit column stride, in torch otherwise.

        Raises:
            ValueError: K is not a multiple of `block`, or block is not a power of two <= 512.
        """
        from loom.quant.hadamard import rotate_input

        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or (x.shape[1] > 1 and x.stride(1) != 1):
            return rotate_input(x, block)
        m, k = x.shape
        if block < 1 or block & (block - 1) or block > 512 or k % block:
            raise ValueError(f"rotation block {block} must be a power of two <= 512 dividing K={k}")
        y = torch.empty(m, k, dtype=torch.float32)
        if m and k:
            self._rotate(x.data_ptr(), x.stride(0) if m > 1 else k, m, k, block, y.data_ptr(), torch.get_num_threads())
        return y

    def quantize_activations16(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float32 or bfloat16 -> the int16 codes gemm_f multiplies (qgemm.c, item 3): codes int16
        [M, K], block scales float32 [M, K/32], sums of the dequantized 16-value halves float32 [M, K/16].
        Exposed for tests; gemm_f quantizes its input itself.

        Raises:
            ValueError: x not a 2-D float32 / bfloat16 CPU matrix with unit column stride, or K % 32 != 0.
        """
        m, k, ldx = _check_x(x)
        codes = torch.empty(m, k, dtype=torch.int16)
        scales = torch.empty(m, k // 32, dtype=torch.float32)
        halves = torch.empty(m, k // 16, dtype=torch.float32)
        if m and k:
            self._quant16(x.data_ptr(), ldx, int(x.dtype == torch.bfloat16), m, k, codes.data_ptr(),
                          scales.data_ptr(), halves.data_ptr(), torch.get_num_threads())
        return codes, scales, halves

    def gemm_q8(self, xa: QuantizedActivations, w: PackedWeight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y [M, N] = xa W^T (+ bias), int8 activations times the packed weight (integer dots per block of
        32, float32 scaling and sums; qgemm.c, item 2). bias float32 [N] or None; out_dtype float32 or
        bfloat16 (nearest even).

        Raises:
            ValueError: wrong dtypes, shapes, devices or layouts (nothing unchecked reaches the C code).
            MemoryError: the kernel's scratch allocation failed.
        """
        if not isinstance(xa, QuantizedActivations):
            raise ValueError(f"xa must be QuantizedActivations, got {type(xa).__name__}")
        m, k = check_activations(xa)
        if not (xa.xq.is_cpu and xa.xs.is_cpu and xa.xsum.is_cpu and xa.xq.is_contiguous() and xa.xs.is_contiguous()
                and xa.xsum.is_contiguous()):
            raise ValueError("QuantizedActivations must hold contiguous CPU tensors")
        n = _check_weight(w, k)
        if w.layout in INTERLEAVED:
            raise ValueError(f"gemm_q8 reads q4g and q8g weights; a {w.layout} weight runs under float activations")
        _check_bias(bias, n)
        _check_out(out_dtype)
        y = torch.empty(m, n, dtype=out_dtype)
        if not (m and n):
            return y
        mins = None if w.mins is None else w.mins.data_ptr()
        b = None if bias is None else bias.data_ptr()
        args = (y.data_ptr(), n, int(out_dtype == torch.bfloat16), torch.get_num_threads())
        fn = self._q4_q8 if w.layout == "q4g" else self._q8_q8
        rc = fn(xa.xq.data_ptr(), xa.xs.data_ptr(), xa.xsum.data_ptr(), m, k, w.qweight.data_ptr(), w.scales.data_ptr(),
                mins, w.group_size, b, *args)
        if rc:
            raise MemoryError("qgemm: scratch allocation failed")
        return y

    def gemm_q8_per_channel(self, xa: QuantizedActivations, w: PackedWeight, bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y [M, N] = ((float(x_q W_q^T) * s_w) * s_x) (+ bias): int8 activations with one scale per row (xa.xs[:, 0];
        per token or static) times a q8g weight with one scale per row (group_size = K, no mins), the dots exact
        int32 sums, so the result equals methods._int8_gemm over torch's exact int8 GEMM bit for bit at any M
        (qgemm.c, item 2b). out_dtype float32 or bfloat16.

        Raises:
            ValueError: wrong dtypes, shapes, devices or layouts, or a weight with groups or mins.
        """
        if not isinstance(xa, QuantizedActivations):
            raise ValueError(f"xa must be QuantizedActivations, got {type(xa).__name__}")
        m, k = check_activations(xa)
        if not (xa.xq.is_cpu and xa.xs.is_cpu and xa.xq.is_contiguous() and xa.xs.is_contiguous()):
            raise ValueError("QuantizedActivations must hold contiguous CPU tensors")
        n = _check_weight(w, k)
        if w.layout != "q8g" or w.group_size != k or w.mins is not None:
            raise ValueError("gemm_q8_per_channel needs a q8g weight with one scale per row (group_size = K), no mins")
        _check_bias(bias, n)
        _check_out(out_dtype)
        y = torch.empty(m, n, dtype=out_dtype)
        if m and n:
            self._q8c(xa.xq.data_ptr(), xa.xs.data_ptr(), xa.xs.stride(0), m, k, w.qweight.data_ptr(),
                      w.scales.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), n,
                      int(out_dtype == torch.bfloat16), torch.get_num_threads())
        return y

    def gemm_f(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y [M, N] = x W^T (+ bias) for weight-only quantization: x quantized to int16 codes per block of 32
        (relative error <= 2^-16 of the block's max|x|: finer than float16 or bfloat16 activations), exact
        integer dots per block, float32 scaling and sums (qgemm.c, item 3). x [M, K] float32 or bfloat16, any row stride
        with unit column stride; bias float32 [N] or None; out_dtype float32 or bfloat16.

        Raises:
            ValueError: wrong dtypes, shapes, devices or layouts.
            MemoryError: the kernel's scratch allocation failed.
        """
        m, k, ldx = _check_x(x)
        n = _check_weight(w, k)
        _check_bias(bias, n)
        _check_out(out_dtype)
        y = torch.empty(m, n, dtype=out_dtype)
        if not (m and n):
            return y
        mins = None if w.mins is None else w.mins.data_ptr()
        b = None if bias is None else bias.data_ptr()
        head = (x.data_ptr(), ldx, int(x.dtype == torch.bfloat16), m, k, w.qweight.data_ptr(), w.scales.data_ptr(),
                mins)
        tail = (b, y.data_ptr(), n, int(out_dtype == torch.bfloat16), torch.get_num_threads())
        # q4gr16 / q8gr16: every build; fast in avx512_vnni ones (`interleaved_layouts`)
        fn = {"q4gr16": self._q4r16_f, "q8gr16": self._q8r16_f, "q4g": self._q4_f, "q8g": self._q8_f}[w.layout]
        rc = fn(*head, w.group_size, *tail)
        if rc:
            raise MemoryError("qgemm: scratch allocation failed")
        return y

    def dequantize_rows(self, w: PackedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of W: [len(ids), K] in `dtype` (float32 or bfloat16), bit for bit
        dequantize(w.rows(ids), dtype), from any layout (an embedding lookup; the interleaved layouts' rows are
        gathered in C). ids: int64 [n] CPU tensor.

        Raises:
            ValueError: dtype not float32 / bfloat16, ids not a 1-D int64 CPU tensor, or an id outside [0, N).
        """
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        if not isinstance(w, PackedWeight):
            raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_cpu:
            raise ValueError(f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        k = w.shape[1]
        n = _check_weight(w, k)
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], k, dtype=dtype)
        if ids.shape[0] and k:
            mins = None if w.mins is None else w.mins.data_ptr()
            rc = self._dq_rows(int(w.layout in Q4_LAYOUTS), int(w.layout in INTERLEAVED), w.qweight.data_ptr(),
                               w.scales.data_ptr(), mins, w.group_size, n, k, ids.data_ptr(), ids.shape[0],
                               out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
            if rc == -1:
                raise ValueError(f"ids must lie in [0, {n}): got {ids.min().item()}..{ids.max().item()}")
            if rc:
                raise MemoryError("dequantize_rows: scratch allocation failed")
        return out

    def dequantize(self, w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype` (float32 or bfloat16), bit for bit layout.dequantize(w, dtype).

        Raises:
            ValueError: dtype not float32 / bfloat16, or the weight's tensors not contiguous CPU tensors.
        """
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        if not isinstance(w, PackedWeight):
            raise ValueError(f"w must be a PackedWeight, got {type(w).__name__}")
        if w.layout in INTERLEAVED:
            w = deinterleave_rows16(w)
        n, k = w.shape
        _check_weight(w, k)
        out = torch.empty(n, k, dtype=dtype)
        if n and k:
            mins = None if w.mins is None else w.mins.data_ptr()
            bf16, threads = int(dtype == torch.bfloat16), torch.get_num_threads()
            fn = self._dq4 if w.layout == "q4g" else self._dq8
            fn(w.qweight.data_ptr(), w.scales.data_ptr(), mins, w.group_size, n, k, out.data_ptr(), bf16, threads)
        return out
