"""Mixed precision: each linear layer's sensitivity to quantization, and the precision of each under a size
budget (`loom quantize --target-bits 4.5`).

Sensitivity follows ZeroQ (Cai et al., "ZeroQ: A Novel Zero Shot Quantization Framework", CVPR 2020, section
3.3): the sensitivity of layer i to format f is the mean KL divergence KL(model || model with only layer i in
f) of the next-token distributions over calibration tokens. Here a "layer" is one of loom's linear groups of a
decoder layer (q/k/v, o, gate/up, down: stacked projections share an input and run as one matrix, so they share
a precision), each format is applied by round to nearest on the grid of the GPTQ format (loom/quant/gptq.py),
and the KL is measured at every position of the calibration windows, float32 throughout. Formats with more
bits on the same groups are not run but estimated (estimate_wider): rounding noise has variance step^2 / 12,
each added bit halves the step, and for small perturbations KL is second order in them, so KL falls 4x per bit
(8 bits: 1/256 of the 4-bit KL); the allocation only needs to know that such an upgrade removes nearly all of a
layer's KL.

Allocation (ZeroQ's Pareto frontier, solved greedily as in its section 3.3, with the additivity assumption it
states): every layer starts in the base format; while the budget allows, the upgrade (to a wider format of the
list, or to 16 bits, whose KL is 0) with the largest drop in KL per added bit is taken. The budget is
`target_bits` times the number of weights of the quantized layers (the decoder's linear layers; embeddings and
LM head stay as they are and are not counted), in bits of the stored checkpoint (unit_bits): `bits` for each code
plus, per group of `group_size` columns, a float16 scale and a `bits`-wide zero point (format_bits), plus the
format's int32 g_idx per input column of each projection; a 16-bit layer is 16 bits a weight.

The plan is written into the GPTQ checkpoint as GPTQModel's `dynamic` quantization_config
(loom/quant/gptq_method.py): a "+:" override with the layer's bits and group size, or a "-:" pattern for a layer
kept in 16 bits (float16 weights in the file).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loom.quant.gptq import rtn_quantize

logger = logging.getLogger(__name__)

Format = tuple[int, int]  # (bits, group_size); group_size -1 = per output channel
DENSE = None  # a layer kept in 16 bits
DEFAULT_UPGRADES: tuple[Format, ...] = ((4, 32),)  # tried above the base, besides 8 bits at its group size and 16


def format_bits(fmt: Format | None, input_size: int) -> float:
    """Stored bits per weight: 16 for DENSE; else bits + ceil(input_size / group_size) (16 + bits) / input_size
    (a float16 scale and a `bits`-wide zero point per group, a last partial group costing a whole one; a
    per-channel group spans all `input_size` columns)."""
    if fmt is DENSE:
        return 16.0
    bits, group_size = fmt
    groups = 1 if group_size == -1 else -(-input_size // group_size)
    return bits + groups * (16 + bits) / input_size


def unit_bits(unit: "Unit", fmt: Format | None) -> float:
    """Stored bits of `unit` in `fmt`: weights x format_bits, plus a GPTQ g_idx (int32 per input column) for
    each of its projections when quantized."""
    g_idx = 0 if fmt is DENSE else 32 * unit.input_size * len(unit.projections)
    return unit.weights * format_bits(fmt, unit.input_size) + g_idx


@dataclass(frozen=True, slots=True)
class Unit:
    """One linear group of one decoder layer."""

    name: str  # loom's layer name, "model.layers.3.mlp.down_proj"
    projections: tuple[str, ...]  # the checkpoint's module names stacked in it
    weights: int  # parameters
    input_size: int


def units_of(model: torch.nn.Module) -> list[Unit]:
    """The decoder's linear groups in order (layer by layer; q/k/v, o, gate/up, down)."""
    from loom.quant.gptq_checkpoint import LINEAR_GROUPS, PROJECTIONS

    units = []
    for i, layer in enumerate(model.model.layers):
        for parent, name in LINEAR_GROUPS:
            lin = getattr(getattr(layer, parent), name)
            head = f"model.layers.{i}.{parent}"
            units.append(Unit(f"{head}.{name}", tuple(f"{head}.{p}" for p in PROJECTIONS[name]),
                              lin.weight.numel(), lin.input_size))
    return units


@torch.inference_mode()
def layer_sensitivity(model: torch.nn.Module, arch: Any, windows: list[list[int]], formats: list[Format],
                      sym: bool) -> dict[tuple[str, Format], float]:
    """ZeroQ sensitivity (module docstring) of every unit to every format: (unit name, format) -> mean KL in
    nats per position. `model` is a dense float32 loom model (quantization "none"); its weights are restored.

    Cost: one forward of the layers from each unit's own onward per (unit, format), on `windows`.
    """
    from loom.quant.gptq_checkpoint import LINEAR_GROUPS, _embed, _run_layer

    layers = model.model.layers
    states = _embed(model, windows)
    reference = _log_probs(model, arch, 0, states)
    out: dict[tuple[str, Format], float] = {}
    bar = tqdm(total=len(layers) * len(LINEAR_GROUPS) * len(formats), desc="sensitivity", unit="trial")
    for i, layer in enumerate(layers):
        for parent, name in LINEAR_GROUPS:
            lin = getattr(getattr(layer, parent), name)
            original = lin.weight.data.clone()
            for fmt in formats:
                bits, group_size = fmt
                lin.weight.data.copy_(rtn_quantize(original, bits, group_size, sym).dequantize())
                lp = _log_probs(model, arch, i, states)
                out[(f"model.layers.{i}.{parent}.{name}", fmt)] = _mean_kl(reference, lp)
                bar.update()
            lin.weight.data.copy_(original)
        states = _run_layer(model, arch, layer, states)
    bar.close()
    return out


def estimate_wider(sensitivity: dict[tuple[str, Format], float], base: Format, wider: Format,
                   ) -> dict[tuple[str, Format], float]:
    """KL of `wider` (more bits, same group size as `base`) from each unit's measured KL in `base`: 4^-(added
    bits) of it (module docstring).

    Raises:
        ValueError: formats that differ in group size, or `wider` without more bits.
    """
    if wider[1] != base[1] or wider[0] <= base[0]:
        raise ValueError(f"estimate_wider needs more bits on the same groups, got {base} -> {wider}")
    factor = 4.0 ** -(wider[0] - base[0])
    return {(name, wider): kl * factor for (name, fmt), kl in sensitivity.items() if fmt == base}


def _log_probs(model: torch.nn.Module, arch: Any, start: int, states: list) -> list[torch.Tensor]:
    """Log-probabilities [T, V] float32 per window from layer `start`'s inputs `states` through the rest."""
    from loom.quant.gptq_checkpoint import _run_layer

    for layer in list(model.model.layers)[start:]:
        states = _run_layer(model, arch, layer, states)
    out = []
    for _tokens, hidden, residual in states:
        normed = model.model.norm(hidden) if residual is None else model.model.norm(hidden, residual)[0]
        out.append(F.log_softmax(model.compute_logits(normed).float(), dim=-1))
    return out


def _mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    total = count = 0.0
    for ref, oth in zip(reference, other, strict=True):
        total += float((ref.exp() * (ref - oth)).sum())
        count += ref.shape[0]
    return total / count


def allocate(units: list[Unit], sensitivity: dict[tuple[str, Format], float], base: Format,
             upgrades: list[Format | None], target_bits: float) -> dict[str, Format | None]:
    """Each unit's format under `target_bits` stored bits per weight (module docstring).

    Args:
        sensitivity: (unit name, format) -> KL for the base and every non-DENSE upgrade (DENSE counts as 0).
        upgrades: formats a unit may move to (DENSE = 16 bits), any order.

    Returns:
        unit name -> format (the base for most).

    Raises:
        ValueError: target_bits below the base format's own bits per weight, or a sensitivity missing.
    """
    total = sum(u.weights for u in units)
    used = sum(unit_bits(u, base) for u in units)
    if target_bits * total < used - 1e-6:
        raise ValueError(f"target_bits {target_bits} is below the {used / total:.3f} bits per weight of "
                         f"{base[0]}-bit groups of {base[1]}")
    budget = target_bits * total - used

    def kl(unit: Unit, fmt: Format | None) -> float:
        if fmt is DENSE:
            return 0.0
        try:
            return sensitivity[(unit.name, fmt)]
        except KeyError:
            raise ValueError(f"no sensitivity of {unit.name} to {fmt}") from None

    plan: dict[str, Format | None] = {u.name: base for u in units}
    while True:
        best = None
        for u in units:
            now = plan[u.name]
            for fmt in upgrades:
                cost = unit_bits(u, fmt) - unit_bits(u, now)
                gain = kl(u, now) - kl(u, fmt)
                if cost <= 0 or cost > budget or gain <= 0:
                    continue
                if best is None or gain / cost > best[0]:
                    best = (gain / cost, u, fmt, cost)
        if best is None:
            return plan
        _, u, fmt, cost = best
        plan[u.name] = fmt
        budget -= cost


def plan_bits(units: list[Unit], plan: dict[str, Format | None]) -> float:
    """Stored bits per weight of the decoder's linear layers under `plan`."""
    total = sum(u.weights for u in units)
    return sum(unit_bits(u, plan[u.name]) for u in units) / total


def dynamic_config(units: list[Unit], plan: dict[str, Format | None], base: Format) -> dict[str, dict[str, Any]]:
    """GPTQModel's `dynamic` map for `plan`: one pattern per unit not in the base format, matching its
    projections' module names and loom's stacked name (loaders match either)."""
    out: dict[str, dict[str, Any]] = {}
    for u in units:
        fmt = plan[u.name]
        if fmt == base:
            continue
        head, _, last = u.name.rpartition(".")
        names = sorted({p.rpartition(".")[2] for p in u.projections} | {last})
        pattern = f"^{re.escape(head)}\\.({'|'.join(names)})$"
        if fmt is DENSE:
            out[f"-:{pattern}"] = {}
        else:
            out[f"+:{pattern}"] = {"bits": fmt[0], "group_size": fmt[1]}
    return out
