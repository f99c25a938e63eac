"""The Hugging Face GPTQ checkpoint format (AutoGPTQ / GPTQModel / transformers + optimum), both ways.

Per quantized linear layer `P` (weight [N, K] in PyTorch's orientation), `bits` in {4, 8}, f = 32 / bits
codes per int32, G groups:

| tensor       | dtype   | shape         | content                                                               |
|--------------|---------|---------------|-----------------------------------------------------------------------|
| P.qweight    | int32   | [K / f, N]    | code of (k, n) in word k // f of column n, bits (k % f) * bits upward |
| P.qzeros     | int32   | [G, N / f]    | zero point of (g, n), packed the same way along n; checkpoint_format  |
|              |         |               | "gptq" (v1) stores zero - 1 (loaders add 1), "gptq_v2" the zero       |
| P.scales     | float16 | [G, N]        | scale of (g, n)                                                       |
| P.g_idx      | int32   | [K]           | group of input column k (k // group_size unless desc_act)             |
| P.bias       | float16 | [N]           | when the layer has one                                                |

and W[n, k] = scales[g, n] * (code[k, n] - zero[g, n]) with g = g_idx[k]. config.json carries
`quantization_config` = {"quant_method": "gptq", "bits", "group_size" (-1: per channel), "desc_act", "sym",
"damp_percent", "true_sequential", "static_groups", "checkpoint_format", ...}.

Into loom's layouts (loom/quant/layout.py), `to_loom`:
- 4-bit -> q4g with the file's groups (group sizes 32, 64, 128, per channel: one scale and min per group, so a
  decode step reads 4 + 32 / group_size bits a weight, as the file stores them), and min = -zero * scale,
  rounded to float16. The codes and scales are the file's own; the min is exact whenever zero * scale is a
  float16 (always for symmetric checkpoints, zero = 8), else within 2^-11 relative of it (as loom's Q4_K
  repacking).
- 8-bit -> q8g: codes - 128 as int8, min = (128 - zero) * scale (0 for symmetric ones, zero = 128).
- Either: loom's groups are the largest of K, 1024, 512, 256, 128, 64, 32 (dividing K) each of whose column
  blocks lies in one GPTQ group: the file's group size where it is one of them, else a divisor (e.g. 32 for a
  group size of 96).
- desc_act with a g_idx that is not monotonic: the input columns are permuted into group order (a stable
  sort of g_idx) and each activation row is gathered by the same permutation at run time (W x = W[:, p] x[p],
  exact, as exllama does); `input_perm` is that permutation.
A layer whose groups do not fall on blocks of 32 (K % 32 != 0, or an irregular g_idx) is dequantized instead
(`dequantize_gptq`, the file's values exactly in float32, no memory saving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.quant.gptq import GPTQWeight
from loom.quant.layout import PackedWeight, pack_q4g

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format values: v1 stores zero - 1, v2 the zero itself


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes (0..2^bits - 1) 32 / bits to an int32 along `dim` (0 or 1) of a 2-D tensor; code j of
    a word sits at bits j * bits upward (two's complement int32, as the format stores it).

    Raises:
        ValueError: the size along dim is not a multiple of 32 / bits, or a code out of range.
    """
    per = 32 // bits
    c = codes.to(torch.int64)
    if dim == 1:
        c = c.T
    if c.shape[0] % per:
        raise ValueError(f"{c.shape[0]} values do not pack {per} to an int32 ({bits}-bit codes)")
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 2**bits):
        raise ValueError(f"codes must lie in 0..{2**bits - 1}")
    c = c.reshape(c.shape[0] // per, per, -1)
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    words = (c << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 1 else words.contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of pack_int32: int32 words -> codes int32, 32 / bits times longer along `dim`."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 1:
        w = w.T
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    codes = (w.unsqueeze(1) >> shifts) & (2**bits - 1)
    codes = codes.reshape(w.shape[0] * per, w.shape[1]).to(torch.int32)
    return codes.T.contiguous() if dim == 1 else codes.contiguous()


def to_checkpoint(weight: GPTQWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales", "g_idx"} of one layer (see the module table).

    Raises:
        ValueError: an unknown format, sizes that do not pack, or a zero of 0 in v1 (not storable).
    """
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
    stored = weight.zeros - (1 if checkpoint_format == "gptq" else 0)
    if checkpoint_format == "gptq" and stored.numel() and int(stored.min()) < 0:
        raise ValueError("a zero point of 0 cannot be stored in checkpoint_format 'gptq' (v1 stores zero - 1)")
    return {
        "qweight": pack_int32(weight.codes.T, weight.bits, dim=0),
        "qzeros": pack_int32(stored, weight.bits, dim=1),
        "scales": weight.scales.half().contiguous(),
        "g_idx": weight.g_idx.to(torch.int32).contiguous(),
    }


def from_checkpoint(tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str = "gptq") -> GPTQWeight:
    """A layer's {"qweight", "qzeros", "scales", "g_idx"} -> GPTQWeight (zeros as the true zero points; the v1
    loaders' arithmetic, zero = stored + 1, so a v1 nibble 15 reads as 16).

    Raises:
        ValueError: an unknown format, a missing tensor, or shapes that disagree.
    """
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
    missing = [name for name in ("qweight", "qzeros", "scales", "g_idx") if name not in tensors]
    if missing:
        raise ValueError(f"GPTQ layer lacks {missing}")
    codes = unpack_int32(tensors["qweight"], bits, dim=0).T.contiguous()  # [N, K]
    zeros = unpack_int32(tensors["qzeros"], bits, dim=1) + (1 if checkpoint_format == "gptq" else 0)
    scales, g_idx = tensors["scales"], tensors["g_idx"].to(torch.int32)
    n, k = codes.shape
    if scales.shape[1] != n or zeros.shape != scales.shape or g_idx.shape != (k,):
        raise ValueError(f"GPTQ shapes disagree: qweight -> [{n}, {k}], qzeros -> {tuple(zeros.shape)}, "
                         f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}")
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"g_idx values must lie in 0..{scales.shape[0] - 1}")
    return GPTQWeight(codes, scales.half(), zeros, g_idx, bits)


@dataclass(slots=True)
class LoomGPTQ:
    """One GPTQ layer in loom's run-time form."""

    packed: PackedWeight | None  # q4g / q8g over the permuted input columns, or None (dense below)
    input_perm: torch.Tensor | None  # int64 [K]: x[:, input_perm] is what `packed` multiplies; None = identity
    dense: torch.Tensor | None  # float32 [N, K] when the groups do not fall on blocks of 32


def to_loom(weight: GPTQWeight) -> LoomGPTQ:
    """The GPTQ layer in loom's layouts (module docstring), exact but for the float16 min of asymmetric
    4-bit groups."""
    n, k = weight.codes.shape
    g_idx = weight.g_idx.long()
    perm = None
    if k > 1 and bool((g_idx[1:] < g_idx[:-1]).any()):
        perm = torch.argsort(g_idx, stable=True)
    order = g_idx if perm is None else g_idx[perm]
    block = _uniform_block(order, k, (k, 1024, 512, 256, 128, 64, 32))
    if block is None:
        return LoomGPTQ(None, None, weight.dequantize())
    codes = weight.codes if perm is None else weight.codes[:, perm]
    groups = order[::block]  # the GPTQ group of each loom group
    scales = weight.scales[groups].T.contiguous()  # float16 [N, K // block]
    zeros = weight.zeros[groups].T.float()
    if weight.bits == 4:
        mins = (-zeros * scales.float()).half()
        packed = pack_q4g(codes, scales, mins)
    else:
        mins = ((128 - zeros) * scales.float()).half()
        packed = PackedWeight("q8g", (codes - 128).to(torch.int8).contiguous(), scales,
                              None if not bool(mins.any()) else mins.contiguous(), block)
    return LoomGPTQ(packed, perm, None)


def _uniform_block(order: torch.Tensor, k: int, sizes: tuple[int, ...]) -> int | None:
    """The first size in `sizes` (a multiple of 32 dividing k) over whose blocks `order` (group per column) is
    constant, or None."""
    for size in sizes:
        if size % 32 or k % size:
            continue
        blocks = order.view(k // size, size)
        if bool((blocks == blocks[:, :1]).all()):
            return size
    return None
