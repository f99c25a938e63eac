"""GPTQ onto W8A8's int8 grid, layer by layer through a (smoothed) dense model: the weight rounding of
`loom quantize --method smoothquant|w8a8 --weight-rounding gptq`.

llm-compressor's W8A8 recipe is SmoothQuant then GPTQ (its SmoothQuantModifier then GPTQModifier with scheme
"W8A8"); QuaRot (Ashkboos et al. 2024, arXiv:2404.00456) pairs a Hadamard rotation with GPTQ the same way. Round to
nearest leaves each weight's error where it falls; GPTQ (Frantar et al. 2022, arXiv:2210.17323) spreads each
rounded column's error over the columns not yet rounded, weighted by the calibration inputs' Hessian, so that the
layer's outputs on those inputs move less. On the bundled model the per-channel int8 weights carry most of W8A8's
loss (benchmarks/NOTES.md, "Run-time W8A8's top-1"), which is what this reduces.

`rotated` quantizes each layer in the basis run-time w8a8 multiplies in (loom/quant/hadamard.py): the weight
W H^T and the Hessian H X X^T H^T of the rotated inputs, so the codes are chosen on the grid the kernel reads.
The layers are taken in order, each one's Hessian from the outputs of the layers already quantized (as
gptq_checkpoint.quantize_model_weights does).
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from loom.quant.gptq import gptq_int8_per_channel
from loom.quant.gptq_checkpoint import LINEAR_GROUPS, PROJECTIONS, _embed, _layer_hessian, _run_layer
from loom.quant.hadamard import rotate, rotation_block

WEIGHT_ROUNDINGS = ("rtn", "gptq")


def gptq_w8a8_weights(arch: Any, tensors: dict[str, torch.Tensor], windows: list[list[int]], *, rotated: bool,
                      percdamp: float = 0.01) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ every decoder projection of the dense checkpoint `tensors` (Hugging Face names, float) onto the int8
    per-channel grid (gptq.gptq_int8_per_channel), calibrated on `windows` (token ids, one prefill each).

    Args:
        arch: the model's ModelArchConfig.
        rotated: choose the codes in the block-Hadamard basis of run-time w8a8 (module docstring).

    Returns:
        projection name ("model.layers.0.self_attn.q_proj") -> (codes int8 [N, K], scales float16 [N]), the codes
        of W H^T when rotated; W ~ codes * scales[:, None] (rotated back by hadamard.rotate when rotated).

    Raises:
        ValueError: no calibration window, or a Hessian singular after damping.
    """
    from loom.attention.backend import default_attention_backend, get_attention_backend
    from loom.model.registry import get_model_class

    if not windows:
        raise ValueError("gptq weight rounding needs at least one calibration window")
    cpu = torch.device("cpu")
    net = get_model_class(arch.architecture)(arch, get_attention_backend(default_attention_backend(cpu)),
                                             torch.float32, cpu)
    net.load_weights((k, v.float()) for k, v in tensors.items())
    net.eval()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode():
        states = _embed(net, windows)
    for i, layer in enumerate(tqdm(net.model.layers, desc="gptq", unit="layer")):
        for parent, name in LINEAR_GROUPS:
            lin = getattr(getattr(layer, parent), name)
            hessian = _layer_hessian(net, arch, layer, lin, states)
            weight = lin.weight.data.float()
            block = rotation_block(weight.shape[1]) if rotated else 0
            if block:  # rotated inputs x H^T: their Hessian is H (X X^T) H^T, and the weight W H^T
                hessian = rotate(rotate(hessian, block).T.contiguous(), block)
                weight = rotate(weight, block)
            codes, scales = gptq_int8_per_channel(weight, hessian, percdamp=percdamp)
            values = codes.float() * scales.float()[:, None]
            lin.weight.data.copy_(rotate(values, block) if block else values)  # later layers see these weights
            start = 0
            for proj, rows in zip(PROJECTIONS[name], lin.output_sizes, strict=True):
                out[f"model.layers.{i}.{parent}.{proj}"] = (codes[start : start + rows], scales[start : start + rows])
                start += rows
        states = _run_layer(net, arch, layer, states)
    return out


__all__ = ["WEIGHT_ROUNDINGS", "gptq_w8a8_weights"]
