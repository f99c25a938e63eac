"""Semi-structured 2:4 sparsity (`loom quantize --method sparse24`): in every group of 4 consecutive input
weights of a row, the 2 of least importance are set to zero.

Importance scores:
- magnitude: |W[n, k]| (the classic baseline; as NVIDIA's ASP applies to 2:4);
- wanda: |W[n, k]| * ||X[k, :]||_2 over the calibration tokens X (Sun, Liu, Bair, Kolter, "A Simple and
  Effective Pruning Approach for Large Language Models", 2023, arXiv:2306.11695, equation 1), compared within
  each row's groups of 4 as the paper does for N:M sparsity, with no weight update.
Wanda's norms are taken layer by layer on the pruned model ("sequential": each layer's inputs come from the
layers before it already pruned), as the paper's reference implementation does.

The output is a dense checkpoint whose pruned weights are zeros (config.json's loom_quantization key says so);
it runs on any method. What a 2:4 kernel could gain is a roofline matter (benchmarks/NOTES.md, "2:4
sparsity"): a decode step reads half the values plus a 2-bit position per kept value, so 16-bit weights go from
16 to 9 bits per weight (0.56x the bytes), int8 from 8 to 5 (0.63x), int4 from 4 to 3 (0.75x); no CPU kernel
is written here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

SCORES = ("magnitude", "wanda")


def prune_24(weight: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with the 2 lowest-`score` entries of every group of 4 consecutive columns set to 0 (ties:
    the earlier column is kept). score: [N, K], same shape.

    Raises:
        ValueError: K not a multiple of 4, or shapes that differ.
    """
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs input_size % 4 == 0, got {k}")
    if score.shape != weight.shape:
        raise ValueError(f"score {tuple(score.shape)} must match weight {tuple(weight.shape)}")
    groups = score.reshape(n, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    top = groups.topk(2, dim=2, sorted=False).indices  # topk keeps the first of equal scores
    keep.scatter_(2, top, True)
    return weight * keep.reshape(n, k).to(weight.dtype)


def wanda_score(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """|W| * ||X_k||_2 (Sun et al. 2023): weight [N, K], input_norm [K] (the l2 norm of input feature k over the
    calibration tokens)."""
    return weight.abs() * input_norm.reshape(1, -1)


@dataclass(slots=True)
class PruneResult:
    output: Path
    score: str
    seconds: float
    calibration: str
    calibration_tokens: int
    sparsity: float  # zero share of the decoder's linear weights


def prune_model_weights(model: torch.nn.Module, arch: Any, score: str, windows: list[list[int]]) -> None:
    """Prune every decoder linear layer of a dense float32 loom model in place (2:4 by `score`)."""
    from loom.quant.gptq_checkpoint import LINEAR_GROUPS, _embed, _run_layer

    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "wanda" and not windows:
        raise ValueError("wanda needs calibration windows")
    states = _embed(model, windows) if score == "wanda" else []
    for layer in tqdm(model.model.layers, desc=f"2:4 {score}", unit="layer"):
        for parent, name in LINEAR_GROUPS:
            lin = getattr(getattr(layer, parent), name)
            w = lin.weight.data
            if score == "magnitude":
                s = w.abs()
            else:
                s = wanda_score(w, _input_norm(model, arch, layer, lin, states))
            lin.weight.data.copy_(prune_24(w, s))
        if score == "wanda":
            states = _run_layer(model, arch, layer, states)


def _input_norm(model: torch.nn.Module, arch: Any, layer: torch.nn.Module, lin: torch.nn.Module,
                states: list) -> torch.Tensor:
    """||X_k||_2 of `lin`'s inputs over every window run through `layer` as it is now."""
    from loom.quant.gptq_checkpoint import _run_layer

    acc: dict[str, Any] = {"sq": None}

    def hook(_m: torch.nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        sq = (x * x).sum(dim=0)
        acc["sq"] = sq if acc["sq"] is None else acc["sq"] + sq

    handle = lin.register_forward_pre_hook(hook)
    try:
        _run_layer(model, arch, layer, states)
    finally:
        handle.remove()
    return acc["sq"].sqrt()


def write_sparse_checkpoint(model: str | None, output: str, score: str, windows: list[list[int]], *,
                            calibration: str = "") -> PruneResult:
    """Prune `model` 2:4 by `score` and write the dense result (float32 safetensors, config.json with the
    loom_quantization marker {"method": "none", "prepared_by": "sparse24", "score": ...}, the tokenizer).

    Raises:
        ValueError: an unknown score, wanda without windows, an output that exists and is not empty, or an
            architecture loom cannot write a config for.
    """
    from loom.model.loader import load_model
    from loom.model.loader.model_loader import resolve_model_path
    from loom.quant.gptq_checkpoint import PROJECTIONS
    from loom.quant.mixed import units_of
    from loom.quant.quantize import CONFIG_KEY, MODEL_TYPES, _check_output, source_checkpoint, write_checkpoint

    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    out = _check_output(output)
    start = time.perf_counter()
    path = resolve_model_path(model)
    loaded = load_model(model, torch.float32, torch.device("cpu"), quantization="none")
    if loaded.arch.architecture not in MODEL_TYPES:
        raise ValueError(f"sparse24 cannot write a config for {loaded.arch.architecture}")
    prune_model_weights(loaded.model, loaded.arch, score, windows)
    source, config = source_checkpoint(path, loaded.arch, set(loaded.eos_token_ids))
    tensors = {name: t.float().contiguous() for name, t in source.items()}
    zeros = total = 0
    for unit in units_of(loaded.model):  # loom's stacked layers back into the checkpoint's projections
        w = loaded.model.get_submodule(unit.name).weight.data
        zeros += int((w == 0).sum())
        total += w.numel()
        head, _, last = unit.name.rpartition(".")
        row = 0
        for proj, rows in zip(PROJECTIONS[last], loaded.model.get_submodule(unit.name).output_sizes, strict=True):
            name = f"{head}.{proj}.weight"
            if name not in tensors:
                raise ValueError(f"the source checkpoint lacks {name}")
            tensors[name] = w[row : row + rows].contiguous().clone()
            row += rows
    config.pop("quantization_config", None)
    tokens = sum(len(w) for w in windows) if score == "wanda" else 0
    config[CONFIG_KEY] = {"method": "none", "prepared_by": "sparse24", "score": score,
                          "calibration": calibration if tokens else "", "calibration_tokens": tokens,
                          "source": str(path)}
    write_checkpoint(out, tensors, config, loaded.tokenizer)
    seconds = time.perf_counter() - start
    return PruneResult(out, score, seconds, calibration if tokens else "", tokens, zeros / total if total else 0.0)
