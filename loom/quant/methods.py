"""Quantized linear methods: packed weights in loom's layouts run by loom's kernels (loom/kernels/quant.py),
and FP8 storage.

`PackedLinearMethod` serves four schemes, which differ only in where the packed weight comes from and in
how activations enter the kernel:

| scheme | weights                                   | activations                                      |
|--------|-------------------------------------------|--------------------------------------------------|
| gguf   | the file's own blocks, repacked exactly   | int16 codes per block of 32 (see below)          |
| w4a16  | RTN 4-bit asymmetric groups of 32 (q4g) | int16 codes per block of 32                      |
| w8a16  | RTN int8 groups of 32, best grid (q8g)    | int16 codes per block of 32                      |
| w8a8   | RTN int8 symmetric, one scale per output  | int8, one dynamic scale per token, after the     |
|        | channel, of the weight rotated by block   | same rotation (loom/quant/hadamard.py); int32    |
|        | Hadamard matrices                         | sums over all of K in torch's int8 GEMM (where   |
|        |                                           | exact; else per block of 32 in loom's kernel)    |

"float" activations (the model dtype) reach the C kernels, which quantize them to int16 codes per block of
32 (2^-16 of the block's max: finer than bfloat16; qgemm.c, item 3): int8 activations per block of 32 (llama.cpp's Q8_0/Q8_1 pairing) ran no faster
on AVX2 and agreed with the float32 top-1 token on only 92% of held-out positions (100% with float ones;
benchmarks/NOTES.md, "Quantized kernels"). Activations are quantized once per layer input: q/k/v and gate/up are stacked into one layer, so one call
serves them all, and a stacked layer whose shards came in different layouts shares that one quantization.
w8a8's rotation: per-token int8 activations agreed with the float32 top-1 token on 91% of held-out positions,
with the input rotated on 97.5% (benchmarks/NOTES.md, "w8a8: rotation and groups"). Its weights have one scale per
output channel so that a whole row of x times a whole row of W is one exact int32 sum: at every row count the
product runs as torch's int8 GEMM (`torch._int_mm`: oneDNN with AMX or VNNI) where it is
exact, y = float(x_q W_q^T) * (s_x s_w), instead of dequantizing. Without VNNI oneDNN's int8 kernel saturates pairs
of products in 16 bits and returns wrong sums without an error (found by review: 4.9% of the sums of Gaussian
codes wrong with oneDNN capped to AVX2), so `int8_gemm_is_exact()` checks it once on values that saturate; and where
the CPU has no int8 dot-product instruction torch's exact fallback is a scalar loop, 40x slower than float32
(`int8_gemm_pays()`). A CPU without an exact, fast int8 GEMM keeps loom's exact kernels, at every row count too
(groups of 32 agreed on ~0.5-1 point more top-1 tokens but cannot be one integer GEMM: benchmarks/NOTES.md,
"W8A8 prefill"). Above `dense_min_rows` rows (prefill, large batches) the other methods' matmuls are
compute-bound, and the weight is dequantized (in C) and multiplied by torch's GEMM instead (benchmarks/NOTES.md,
"Quantized kernels"), except q4g under float activations where the kernels have row groups (`row_group_min_rows`:
the avx512_vnni build, 16 weight rows per vector, ~1.9x torch's float32 GEMM on a Zen 4; benchmarks/NOTES.md,
"q4g32 at many rows").
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.build import cpu_flags
from loom.kernels.registry import get_kernel
from loom.model.layers.linear import Linear, copy_rows
from loom.quant.hadamard import rotate_weight, rotation_block
from loom.quant.layout import INTERLEAVED, PackedWeight, dequantize, interleavable, interleave_rows16
from loom.quant.rtn import quantize_fp8_e4m3, quantize_q4g32, quantize_q8, quantize_q8_asym
from loom.quant.torch_kernels import TorchQuantKernels

# Rows above which a packed layer dequantizes and runs torch's GEMM, per layout (measured on Zen 3 with the
# cache-blocked M > 1 tiles, benchmarks/NOTES.md "Fourth pass": SmolLM2's four q4g layer matrices cross
# over at ~200 rows, q8g ones at ~64; the LM head's dequantization alone costs 74 ms, so it stays packed at
# every batch here). A layer of several layouts takes the smallest.
DENSE_MIN_ROWS_BY_LAYOUT = {"q4g": 128, "q8g": 64}
DENSE_MIN_ROWS = min(DENSE_MIN_ROWS_BY_LAYOUT.values())  # the C decode step's batch limit: every layout packed


@dataclass(frozen=True, slots=True)
class PackedScheme:
    """How one quantization method packs weights and feeds activations."""

    name: str  # "gguf", "w4a16", "w8a16", "w8a8"
    # "q8_block" (int8 per 32), "q8_token" (int8 per token), "q8_static" (int8 with the checkpoint's input_scale)
    # or "float"
    activations: str
    prepacked: bool  # the checkpoint delivers PackedWeight (GGUF); else dense weights quantized at load
    rotated: bool = False  # inputs and weights rotated by block Hadamard matrices (loom/quant/hadamard.py)


SCHEMES = {
    "gguf": PackedScheme("gguf", "float", True),
    "w4a16": PackedScheme("w4a16", "float", False),
    "w8a16": PackedScheme("w8a16", "float", False),
    "w8a8": PackedScheme("w8a8", "q8_token", False, rotated=True),
    "gptq": PackedScheme("gptq", "float", True),  # a GPTQ checkpoint's own codes (loom/quant/gptq_method.py)
    # a compressed-tensors int8 checkpoint's own codes and scales (loom/quant/int8_checkpoint.py)
    "int8_dynamic": PackedScheme("int8_dynamic", "q8_token", True),
    "int8_static": PackedScheme("int8_static", "q8_static", True),
    "int8_weight_only": PackedScheme("int8_weight_only", "float", True),
}


def quant_kernels(device: torch.device) -> Any:
    """loom's C kernels for packed weights on this CPU (best ISA), else the torch implementation (any device,
    a CPU without a compiler, CUDA)."""
    if device.type == "cpu":
        kernel = get_kernel("qgemm")
        if kernel is not None:
            return kernel
    return TorchQuantKernels()


def quantize_for_scheme(scheme: str, weight: torch.Tensor) -> PackedWeight:
    """Dense weight [N, K] -> the packed form of `scheme` (RTN, loom/quant/rtn.py)."""
    if scheme == "w4a16":
        return quantize_q4g32(weight)
    if scheme == "w8a16":
        return quantize_q8_asym(weight, 32)
    if scheme == "w8a8":
        return quantize_q8(weight, weight.shape[1])  # per output channel: one int32 sum per (row of x, row of W)
    raise ValueError(f"scheme {scheme!r} does not quantize dense weights")


class PackedLinearMethod:
    """Weights in loom's packed layouts (loom/quant/layout.py), multiplied by loom's kernels."""

    def __init__(self, scheme: str, source_label: str = "", dense_min_rows: int | None = None) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown packed scheme {scheme!r}; known: {sorted(SCHEMES)}")
        self.scheme = SCHEMES[scheme]
        self.source_label = source_label  # e.g. "GGUF Q4_1", for the start-up report
        # rows from which dequantize + torch GEMM runs instead; None: by layout, once the weights are packed
        self.dense_min_rows = DENSE_MIN_ROWS if dense_min_rows is None else dense_min_rows
        self._dense_rows_by_layout = dense_min_rows is None
        self.kernels: Any = None  # QuantKernels or TorchQuantKernels, set after loading

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        rows = sum(output_sizes)
        layer.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)
        if bias:
            layer.weight_loaders["bias"] = lambda t, shard: copy_rows(layer, layer.bias, t, shard)
        if self.scheme.prepacked:
            # one slot per shard: a PackedWeight, or a dense tensor for a shard the file keeps unquantized
            layer.packed_shards = [None] * len(output_sizes)
            layer.weight_loaders["weight"] = lambda t, shard: self._store_shard(layer, t, shard)
        else:  # a dense checkpoint: stage it, quantize after loading
            layer.weight = nn.Parameter(torch.empty(rows, input_size, dtype=dtype, device=device),
                                        requires_grad=False)
            layer.weight_loaders["weight"] = lambda t, shard: copy_rows(layer, layer.weight, t, shard)
        if self.scheme.activations == "q8_static":  # each shard's input_scale; the layer takes the largest
            layer.input_scales = [None] * len(output_sizes)
            layer.weight_loaders["input_scale"] = lambda t, shard: layer.input_scales.__setitem__(
                0 if shard is None else shard, float(t.float().reshape(-1)[0]))
        layer.packed = []  # run-time form: PackedWeights covering the rows in order
        layer.packed_bias = []  # float32 bias slice per PackedWeight, or None
        layer.dense_weight = None  # set instead when a stacked layer mixes packed and dense shards
        layer.rotation_block = 0  # channels per Hadamard block of a rotated scheme, 0 = no rotation
        layer.input_perm = None  # int64 [input_size]: the packed weight multiplies x[:, input_perm] (GPTQ desc_act)
        layer.int_gemm = False  # int8 activations per row, every part int8 per channel without mins: exact dots
        layer.int_gemm_torch = False  # ... in torch's int8 GEMM (exact and fast here), else in loom's kernel
        layer.input_scale = None  # q8_static: the scale x is quantized with

    @staticmethod
    def _store_shard(layer: Linear, tensor: Any, shard: int | None) -> None:
        index = 0 if shard is None else shard
        rows = layer.output_sizes[index] if shard is not None else layer.output_size
        shape = tensor.shape if isinstance(tensor, PackedWeight) else tuple(tensor.shape)
        if tuple(shape) != (rows, layer.input_size):
            raise ValueError(f"checkpoint tensor shape {tuple(shape)} != parameter shape {(rows, layer.input_size)}")
        layer.packed_shards[index] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        device = layer.device  # a file's packed blocks (and a GPTQ permutation) arrive on the CPU
        if self.scheme.prepacked:
            shards = layer.packed_shards
            if any(s is None for s in shards):
                raise ValueError(f"{layer.prefix}: checkpoint lacks a shard of this layer")
            if not all(isinstance(s, PackedWeight) for s in shards):
                # a shard the file keeps in float: the whole stacked layer runs dense
                dense = [dequantize(s) if isinstance(s, PackedWeight) else s.float() for s in shards]
                layer.dense_weight = torch.cat(dense).to(device=device, dtype=layer.dtype)
                layer.packed_shards = []
                return
            packed = list(shards)
            layer.packed_shards = []
        else:
            weight = layer.weight.data
            if self.scheme.rotated:
                layer.rotation_block = rotation_block(layer.input_size)
                weight = rotate_weight(weight, layer.rotation_block)
            packed = [quantize_for_scheme(self.scheme.name, weight)]
            layer.weight = None  # the dense staging copy is dropped (a tied embedding keeps its own)
        layer.packed = [p.to(device) for p in _merge_if_uniform(packed)]
        if layer.input_perm is not None:
            layer.input_perm = layer.input_perm.to(device)
        int8_per_token = self.scheme.activations in ("q8_token", "q8_static")
        layer.int_gemm = int8_per_token and all(
            p.layout == "q8g" and p.group_size == p.shape[1] and p.mins is None for p in layer.packed) and all(
            p.qweight.device.type == "cpu" for p in layer.packed)
        layer.int_gemm_torch = layer.int_gemm and int8_gemm_pays()
        if self.scheme.activations == "q8_static":
            if any(s is None or not s > 0 for s in layer.input_scales):
                raise ValueError(f"{layer.prefix}: input_scale must be a positive number for every shard")
            layer.input_scale = max(layer.input_scales)
        if self._dense_rows_by_layout:
            self.dense_min_rows = min(DENSE_MIN_ROWS_BY_LAYOUT.get(p.layout, DENSE_MIN_ROWS) for p in layer.packed)
            if int8_per_token and not layer.int_gemm and device.type == "cpu":
                # per-token int8 activations without a fast exact int8 GEMM: loom's kernel at every row count, so
                # that a token's result does not depend on its step's row count (as the GEMM's does not)
                self.dense_min_rows = sys.maxsize
        self.kernels = quant_kernels(device)
        if self.scheme.activations == "float" and getattr(self.kernels, "interleaved_layouts", ()):
            # the 16-row groups at every row count: faster than the tiles from 2 rows up and at one row as fast,
            # and one summation order, so a row's bits do not depend on its batch (benchmarks/NOTES.md, "One
            # summation order at every batch"); a part whose rows are not a multiple of 16 (or a q8g one with
            # other groups) keeps its row-major layout and the tiles
            layer.packed = [interleave_rows16(p) if interleavable(p) else p for p in layer.packed]
        bias = layer.bias.data.float() if layer.bias is not None else None
        layer.packed_bias, start = [], 0
        for p in layer.packed:
            rows = p.shape[0]
            layer.packed_bias.append(None if bias is None else bias[start : start + rows].contiguous())
            start += rows

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.dense_weight is not None:
            return F.linear(x, layer.dense_weight, layer.bias)
        kernels = self.kernels
        if layer.rotation_block:
            x = kernels.rotate_input(x, layer.rotation_block)
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        if layer.int_gemm:
            # exact int32 dots and one float epilogue, in torch's int8 GEMM where it is exact and fast, else in loom's
            # kernel: the same bits either way at every row count, so a token's result does not depend on how many
            # rows its step had (with a per-block kernel below 8 rows a prefix-cache hit changed greedy output:
            # fresh-user trial), and the C decode step (the same kernel) serves decode on either kind of CPU
            xa = self._int8_activations(layer, x)
            gemm = _int8_gemm if layer.int_gemm_torch else kernels.gemm_q8_per_channel
            outs = [gemm(xa, p, b, x.dtype) for p, b in zip(layer.packed, layer.packed_bias, strict=True)]
        elif x.shape[0] > self.dense_min_rows:
            if self.scheme.activations != "float":  # keep the int8 activations' numerics (w8a8 has no mins)
                xa = self._int8_activations(layer, x)
                m, k = xa.xq.shape
                x = (xa.xq.to(x.dtype).view(m, k // 32, 32) * xa.xs.to(x.dtype).unsqueeze(-1)).view(m, k)
            groups = self.scheme.activations == "float" and x.shape[0] >= (
                getattr(kernels, "row_group_min_rows", None) or sys.maxsize)
            outs = [kernels.gemm_f(x, p, b, x.dtype) if (groups and p.layout == "q4g") or p.layout in INTERLEAVED
                    else F.linear(x, kernels.dequantize(p, x.dtype), None if b is None else b.to(x.dtype))
                    for p, b in zip(layer.packed, layer.packed_bias, strict=True)]
        elif self.scheme.activations == "float":
            outs = [kernels.gemm_f(x, p, b, x.dtype) for p, b in zip(layer.packed, layer.packed_bias, strict=True)]
        else:
            xa = self._int8_activations(layer, x)
            outs = [kernels.gemm_q8(xa, p, b, x.dtype) for p, b in zip(layer.packed, layer.packed_bias, strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _int8_activations(self, layer: Linear, x: torch.Tensor) -> Any:
        """x [M, K] as int8 codes for the q8 schemes: per block of 32 ("q8_block"), per token ("q8_token"), or
        round(x / input_scale) clamped to -127..127 with the checkpoint's scale ("q8_static")."""
        if self.scheme.activations != "q8_static":
            return self.kernels.quantize_activations(x, per_token=self.scheme.activations == "q8_token")
        from loom.kernels.quant import QuantizedActivations

        m, k = x.shape
        xq = torch.div(x.float(), layer.input_scale).round_().clamp_(-127, 127).to(torch.int8)
        xs = torch.full((m, k // 32), layer.input_scale, dtype=torch.float32, device=x.device)
        return QuantizedActivations(xq, xs, torch.zeros(m, k // 32, device=x.device))

    def weight_format(self, layer: Linear) -> tuple[str, int]:
        if layer.dense_weight is not None:
            return f"{layer.dense_weight.dtype}".removeprefix("torch."), layer.dense_weight.nbytes
        layouts = "+".join(sorted({p.label for p in layer.packed}))
        source = ", ".join(filter(None, [self.source_label,
                                         f"Hadamard {layer.rotation_block}" if layer.rotation_block else ""]))
        label = f"{self.scheme.name} {layouts}" + (f" ({source})" if source else "")
        return label, sum(p.nbytes for p in layer.packed)


# CPU flags of an int8 dot-product instruction (VNNI, AMX): where oneDNN's int8 GEMM is both exact and fast
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_gemm_pays() -> bool:
    """Whether w8a8 should multiply in torch's CPU int8 GEMM: its sums are exact here (int8_gemm_is_exact) and the
    CPU has an int8 dot-product instruction. Without one (AVX2 only: Zen 1-3, Intel before Ice Lake) torch 2.13's
    `_int_mm` is exact but a scalar loop: 166 ms for [512, 576] x [576, 1728] on a Zen 3 core pair, 40x the float32
    GEMM; w8a8's TTFT at 512 tokens was 16.2 s there against 0.95 s through loom's kernels."""
    return bool(INT8_DOT_FLAGS & cpu_flags()) and int8_gemm_is_exact()


@functools.cache
def int8_gemm_is_exact() -> bool:
    """Whether torch's CPU int8 GEMM (`torch._int_mm`) returns exact int32 sums here, checked once (per process)
    on codes whose pairs of products overflow int16 once the activations are shifted to unsigned (2 x 255 x 127 >
    32,767: what oneDNN's AVX2 kernel does before VPMADDUBSW, which saturates) and on -128 weights. oneDNN with VNNI
    or AMX passes; its AVX2 kernel (Zen 1-3, Intel without VNNI) fails, and so does a torch without a CPU _int_mm."""
    try:
        a = torch.full((17, 64), 127, dtype=torch.int8)
        a[1::2] = -127
        b = torch.full((64, 8), 127, dtype=torch.int8)
        b[:, 1::2] = -128
        want = a.long() @ b.long()
        return bool(torch.equal(torch._int_mm(a, b).long(), want)
                    and torch.equal(torch._int_mm(a, b.t().contiguous().t()).long(), want))
    except (RuntimeError, NotImplementedError):
        return False


def _int8_gemm(xa: Any, w: PackedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = (float(x_q W_q^T) * s_w) * s_x (+ bias) in `dtype`: per-token int8 activations xa
    (QuantizedActivations, one scale per row) times a per-channel int8 weight w (q8g with group_size = K, no mins),
    the integer sums exact in torch's int8 GEMM (int32 accumulation; |sum| <= K * 127^2 < 2^31 for K < 133,000).
    In place after the conversion: a broadcast multiply into a new tensor ran 10x slower here."""
    y = torch._int_mm(xa.xq, w.qweight.t()).float()
    y.mul_(w.scales.float().t()).mul_(xa.xs[:, :1])
    if bias is not None:
        y.add_(bias)
    return y.to(dtype)


def _merge_if_uniform(packed: list[PackedWeight]) -> list[PackedWeight]:
    """Stack shards into one PackedWeight when they share layout, group size and the presence of mins."""
    first = packed[0]
    if len(packed) == 1 or any(p.layout != first.layout or p.group_size != first.group_size
                               or (p.mins is None) != (first.mins is None) for p in packed):
        return packed
    return [PackedWeight(first.layout, torch.cat([p.qweight for p in packed]).contiguous(),
                         torch.cat([p.scales for p in packed]).contiguous(),
                         None if first.mins is None else torch.cat([p.mins for p in packed]).contiguous(),
                         first.group_size)]


# Rows of x up to which Fp8LinearMethod runs loom's gemv_fp8 on the CPU (and the C decode step serves an fp8 model).
# Above, the weight is dequantized into a scratch for F.linear. Measured on a 2-core AMD EPYC (Zen 4), avx512_vnni
# build, gemv / dequantize + F.linear in ms: [3072, 576] 0.93 / 1.16 at 32 rows, 1.87 / 1.91 at 64, 3.82 / 3.02 at
# 128, 15.5 / 12.4 at 512; [576, 1536] 1.21 / 1.78 at 64, 2.36 / 2.40 at 128; [960, 576] 0.58 / 1.26 at 64
# (F.linear reading a matrix just written by two threads ran 2-5x slower than on one written long before:
# benchmarks/NOTES.md, "FP8 weights on the CPU"). The kernel runs ~60 GFMA/s from 8 rows up, torch's float32
# GEMM ~75-80 at 512.
FP8_GEMV_MAX_ROWS = 64


_FP8_SCRATCH = threading.local()  # .buf: this thread's float32 scratch for _fp8_dense


def _fp8_dense(kernel: Any, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] (`fp8 * scale`) for F.linear over many rows, written into this thread's scratch,
    grown to the largest matrix met and then reused: a fresh [N, K] float32 tensor cost more in page faults than
    the product itself once the matrix outgrew the caches ([8192, 2048] at 8 rows: 31.6 ms against 9.4 for the
    float32 GEMM alone, 2-core Zen 4). The scratch holds one matrix in float32 (7 MB for SmolLM2-135M, 110 MB for
    Qwen2.5-1.5B's gate/up projection); the view is consumed before the next call reuses it."""
    buf = getattr(_FP8_SCRATCH, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        buf = _FP8_SCRATCH.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return kernel.dequantize(weight, scale, out=buf[: weight.numel()])


class Fp8LinearMethod:
    """FP8 (e4m3, OCP FP8 spec) weights with a float32 scale per output channel, quantized at load from a dense
    checkpoint (scale = max|w| / 448) or read from a compressed-tensors FP8 checkpoint.

    On a GPU the weight stays in fp8 and each matmul dequantizes it to the activation dtype (half the memory of
    bf16). On the CPU with float32 activations (the default there: model_runner.PACKED_CPU_METHODS) the weight
    stays in fp8 too: up to FP8_GEMV_MAX_ROWS rows of x, loom's `gemv_fp8` kernel decodes it in registers
    (csrc/gemv_fp8.c: a quarter of float32's bytes a decode step reads); above, the kernel's `dequantize` writes
    the float32 weight (`fp8 * scale`, one rounding) into a reused per-thread scratch for F.linear (_fp8_dense).
    With bfloat16 activations,
    or without loom's kernels (LOOM_CPU_KERNELS=0, no C compiler), the weight is dequantized once, at load, to the
    activation dtype: fp8's numerics without its memory saving.

    Raises (process_weights_after_loading):
        ValueError: a weight_scale for only some shards, an fp8 weight holding NaN (0x7F / 0xFF bytes), or scales
            that are NaN, infinite or negative.
    """

    def __init__(self, checkpoint_scales: bool = False) -> None:
        """checkpoint_scales: the checkpoint holds the fp8 values and a weight_scale per layer
        (loom/quant/fp8_checkpoint.py); else the dense weight is quantized at load."""
        self.checkpoint_scales = checkpoint_scales

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        rows = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(rows, input_size, dtype=dtype, device=device), requires_grad=False)
        layer.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)
        layer.weight_loaders["weight"] = lambda t, shard: copy_rows(layer, layer.weight, t, shard)
        if bias:
            layer.weight_loaders["bias"] = lambda t, shard: copy_rows(layer, layer.bias, t, shard)
        layer.fp8_weight = None  # float8_e4m3fn [N, K] (GPU; CPU under float32 activations)
        layer.fp8_scale = None  # float32 [N, 1] ([N] for the CPU kernel)
        layer.dense_weight = None  # the fp8 values dequantized once (CPU, bfloat16 activations or no kernels)
        layer.fp8_kernel = None  # loom's gemv_fp8 binding (CPU, float32 activations)
        # an FP8 checkpoint's own scales (loom/quant/fp8_checkpoint.py), per shard: its weight is then the fp8
        # values themselves (exact in any float dtype), used as they are
        layer.fp8_file_scales = [None] * len(output_sizes)
        if self.checkpoint_scales:
            layer.weight_loaders["weight_scale"] = lambda t, shard: self._store_scale(layer, t, shard)

    @staticmethod
    def _store_scale(layer: Linear, tensor: Any, shard: int | None) -> None:
        index = 0 if shard is None else shard
        rows = layer.output_sizes[index]
        scale = torch.as_tensor(tensor, dtype=torch.float32).reshape(-1, 1)
        if scale.shape[0] not in (1, rows):
            raise ValueError(f"{layer.prefix}: weight_scale has {scale.shape[0]} values, expected 1 or {rows}")
        layer.fp8_file_scales[index] = scale.expand(rows, 1).clone()

    def process_weights_after_loading(self, layer: Linear) -> None:
        scales = layer.fp8_file_scales
        layer.fp8_file_scales = None
        if all(s is None for s in scales):
            layer.fp8_weight, layer.fp8_scale = quantize_fp8_e4m3(layer.weight.data)
        elif any(s is None for s in scales):
            raise ValueError(f"{layer.prefix}: the checkpoint has a weight_scale for only some of its shards")
        else:
            layer.fp8_weight = layer.weight.data.to(torch.float8_e4m3fn)
            layer.fp8_scale = torch.cat(scales).to(layer.weight.device)
        layer.weight = None
        nan = (layer.fp8_weight.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise ValueError(f"{layer.prefix}: the fp8 weight holds {int(nan.sum())} NaN values")
        bad = ~torch.isfinite(layer.fp8_scale) | (layer.fp8_scale < 0)
        if bool(bad.any()):
            raise ValueError(f"{layer.prefix}: the fp8 weight's scales hold {int(bad.sum())} NaN, infinite or negative "
                             "values")
        layer.fp8_kernel = None
        if layer.fp8_weight.device.type == "cpu":
            kernel = get_kernel("gemv_fp8") if layer.dtype == torch.float32 else None
            if kernel is None:
                layer.dense_weight = (layer.fp8_weight.to(torch.float32) * layer.fp8_scale).to(layer.dtype)
                layer.fp8_weight = None
                return
            layer.fp8_kernel = kernel
            layer.fp8_weight = layer.fp8_weight.contiguous()
            layer.fp8_scale = layer.fp8_scale.reshape(-1).contiguous()  # [N] for the kernel

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.dense_weight is not None:
            return F.linear(x, layer.dense_weight, layer.bias)
        kernel = layer.fp8_kernel
        if kernel is not None:  # CPU, float32 activations
            if x.dim() == 2 and x.shape[0] <= FP8_GEMV_MAX_ROWS and x.dtype == torch.float32:
                return kernel(x, layer.fp8_weight, layer.fp8_scale, layer.bias)
            return F.linear(x, _fp8_dense(kernel, layer.fp8_weight, layer.fp8_scale).to(x.dtype), layer.bias)
        w = (layer.fp8_weight.to(torch.float32) * layer.fp8_scale).to(x.dtype)
        return F.linear(x, w, layer.bias)

    def weight_format(self, layer: Linear) -> tuple[str, int]:
        if layer.dense_weight is not None:
            return f"fp8_e4m3 values held as {str(layer.dense_weight.dtype).removeprefix('torch.')}", \
                layer.dense_weight.nbytes
        return "fp8_e4m3", layer.fp8_weight.numel() + layer.fp8_scale.numel() * 4


# Rows up to which Bf16WeightMethod runs loom's GEMV (memory-bound: half the bytes of float32 weights); above,
# the product is compute-bound and torch's float32 GEMM on the widened weight is faster.
BF16_GEMV_MAX_ROWS = 8


class Bf16WeightMethod:
    """Weights stored in bfloat16, activations and sums in the model dtype (float32 on a CPU without native
    bf16): a bf16 checkpoint's own values exactly (every bfloat16 is a float32), at half the bytes of
    float32 weights. Up to BF16_GEMV_MAX_ROWS rows, loom's `gemv_w16` kernel widens the weights in registers
    (csrc/gemv_w16.c); above, the weight is widened to the activation dtype and F.linear runs. Other dtypes
    or devices widen and call F.linear at every size."""

    def __init__(self, device: torch.device) -> None:
        self.gemv = get_kernel("gemv_w16") if device.type == "cpu" else None

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        rows = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(rows, input_size, dtype=torch.bfloat16, device=device),
                                    requires_grad=False)  # [output_size, input_size] bfloat16
        layer.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)  # [output_size] model dtype, or None
        layer.weight_loaders["weight"] = lambda t, shard: copy_rows(layer, layer.weight, t, shard)
        if bias:
            layer.weight_loaders["bias"] = lambda t, shard: copy_rows(layer, layer.bias, t, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass  # the bfloat16 parameter the loaders filled is already the kernel's contiguous layout

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= BF16_GEMV_MAX_ROWS \
                and (layer.bias is None or layer.bias.dtype == torch.float32):
            return self.gemv(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight.to(x.dtype), layer.bias)

    def weight_format(self, layer: Linear) -> tuple[str, int]:
        return "bf16 weights", layer.weight.numel() * 2
