"""The AutoAWQ "gemm" checkpoint format (what AutoAWQ writes and transformers, vLLM and GPTQModel read), both ways.

Per quantized linear layer `P` (weight [N, K] in PyTorch's orientation), 4 bits, G = K / group_size groups:

| tensor     | dtype   | shape      | content                                                                    |
|------------|---------|------------|----------------------------------------------------------------------------|
| P.qweight  | int32   | [K, N / 8] | codes of input row k; word j holds output columns 8j..8j+7, the code of    |
|            |         |            | column 8j + ORDER[i] at bits 4i upward, ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    |
| P.qzeros   | int32   | [G, N / 8] | zero point of (g, n), packed as qweight (the zero itself, no offset)        |
| P.scales   | float16 | [G, N]     | scale of (g, n)                                                            |
| P.bias     | float16 | [N]        | when the layer has one                                                     |

W[n, k] = scales[k // group_size, n] * (code[k, n] - zero[k // group_size, n]). AutoAWQ needs K % group_size == 0;
loom also writes and reads a last, shorter group (G = ceil(K / group_size), as GPTQ's format allows), which
loaders that assume G = K / group_size (AutoAWQ, vLLM) refuse. Note the transposition against
GPTQ: AWQ packs along the output dimension (qweight [K, N/8]), GPTQ along the input ([K/8, N]), and AWQ has no
g_idx. config.json: `quantization_config` = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size",
"zero_point": true, "modules_to_not_convert": null}.

The decoded layer is a loom.quant.gptq.GPTQWeight, so it reaches loom's q4g layout through the same
repacking as GPTQ (gptq_format.to_loom: a group of 128 is a q4g group of 128 with its scale; min = -zero * scale
in float16).
"""

from __future__ import annotations

from typing import Any

import torch

from loom.quant.gptq import GPTQWeight

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column ORDER[i] of its eight
VERSIONS = ("gemm",)
AWQ_TENSORS = ("qweight", "qzeros", "scales")


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """codes int [R, C] (0..15) -> int32 [R, C / 8] in AWQ's order (module table).

    Raises:
        ValueError: C is not a multiple of 8, or a code out of range.
    """
    r, c = codes.shape
    if c % 8:
        raise ValueError(f"{c} columns do not pack 8 to an int32")
    x = codes.to(torch.int64)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > 15):
        raise ValueError("codes must lie in 0..15")
    x = x.reshape(r, c // 8, 8)[:, :, list(ORDER)]  # nibble i <- column ORDER[i]
    words = (x << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_awq: int32 [R, C / 8] -> codes int32 [R, C]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = (w.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int64) * 4)) & 0xF  # [R, C/8, 8] by nibble
    codes = torch.empty_like(nibbles)
    codes[:, :, list(ORDER)] = nibbles  # column ORDER[i] <- nibble i
    return codes.reshape(w.shape[0], -1).to(torch.int32).contiguous()


def to_checkpoint(weight: GPTQWeight) -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales"} of one 4-bit layer with contiguous groups (module table).

    Raises:
        ValueError: not 4 bits, a g_idx that is not k // group_size, or sizes that do not pack.
    """
    if weight.bits != 4:
        raise ValueError(f"the AWQ gemm format holds 4-bit codes, got {weight.bits}")
    n, k = weight.codes.shape
    size = int((weight.g_idx == 0).sum())
    if size == 0 or not torch.equal(weight.g_idx.long(), torch.arange(k) // size):
        raise ValueError("the AWQ format needs contiguous groups (no act-order g_idx)")
    return {"qweight": pack_awq(weight.codes.T), "qzeros": pack_awq(weight.zeros),
            "scales": weight.scales.half().contiguous()}


def from_checkpoint(tensors: dict[str, torch.Tensor], group_size: int | None = None) -> GPTQWeight:
    """A layer's {"qweight", "qzeros", "scales"} -> GPTQWeight (codes [N, K], g_idx = k // group_size).

    group_size: the config's; None = K / (rows of scales). A last, shorter group (K not a multiple of
    group_size, as loom writes for SmolLM2's 576 inputs at 128) needs it given.

    Raises:
        ValueError: a missing tensor, or shapes that disagree.
    """
    missing = [name for name in AWQ_TENSORS if name not in tensors]
    if missing:
        raise ValueError(f"AWQ layer lacks {missing}")
    codes = unpack_awq(tensors["qweight"]).T.contiguous()  # [N, K]
    zeros = unpack_awq(tensors["qzeros"])
    scales = tensors["scales"]
    n, k = codes.shape
    size = group_size if group_size is not None else k // max(1, scales.shape[0])
    if (scales.dim() != 2 or scales.shape[1] != n or zeros.shape != scales.shape or size < 1
            or scales.shape[0] != -(-k // size)):
        raise ValueError(f"AWQ shapes disagree: qweight -> [{n}, {k}] (N, K), qzeros -> {tuple(zeros.shape)}, "
                         f"scales {tuple(scales.shape)}, quantization_config.group_size {group_size}")
    if k % size and size % 32:  # e.g. 139 for a file written at 128: the same number of groups, other boundaries
        raise ValueError(f"quantization_config.group_size {size} does not divide the layer's {k} inputs, and a last, "
                         "shorter group is read only for group sizes that are multiples of 32 (as loom writes them): "
                         "the config's group_size does not match this file")
    g_idx = (torch.arange(k) // size).to(torch.int32)
    return GPTQWeight(codes, scales.half(), zeros, g_idx, 4)


def quantization_config(group_size: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json's quantization_config for an AWQ gemm checkpoint (the keys transformers' AwqConfig reads)."""
    config: dict[str, Any] = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size,
                              "zero_point": True, "modules_to_not_convert": None}
    if meta:
        config["meta"] = meta
    return config


def check_quantization_config(config: dict[str, Any]) -> int:
    """Validate an AWQ quantization_config; returns its group size.

    Raises:
        ValueError: not quant_method "awq", a version other than gemm, bits other than 4, or zero_point false.
    """
    if config.get("quant_method") != "awq":
        raise ValueError(f"quantization_config.quant_method must be 'awq', got {config.get('quant_method')!r}")
    version = str(config.get("version", "gemm")).lower()
    if version not in VERSIONS:
        raise ValueError(f"quantization_config.version must be one of {VERSIONS} (AWQ's gemv layouts are not "
                         f"read), got {config.get('version')!r}")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4 for AWQ, got {bits!r}")
    if config.get("zero_point", True) is not True:
        raise ValueError("quantization_config.zero_point must be true (symmetric AWQ checkpoints are not read)")
    group_size = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"quantization_config.group_size must be a positive integer, got {group_size!r}")
    return group_size
