"""AWQ (Lin et al. 2023, arXiv:2306.00978) over a loom Llama-family model: per decoder layer, search the scales of
each group of linears that share an input, fold them into the op before, clip, and quantize.

| group (loom layer)      | reads                    | block whose output error counts | 1/s folded into          |
|-------------------------|--------------------------|---------------------------------|--------------------------|
| qkv_proj (q, k, v)      | input_layernorm(h)       | self-attention (through o_proj) | input_layernorm.weight   |
| o_proj                  | attention output         | o_proj                          | v_proj's rows (and bias) |
| gate_up_proj (gate, up) | post_attention_layernorm | the MLP (through down_proj)     | post_attention_layernorm |
| down_proj               | silu(gate) * up          | down_proj                       | up_proj's rows           |

o_proj is scaled only when v_proj and o_proj have the same shape (no grouped-query attention), as the reference
implementation does: with GQA one V channel feeds several o_proj columns, which would have to share one scale.
The scale formulas searched are AWQSettings.scaling's (awq.search_scales; default "both": the paper's and duo
scaling's grids). The search compares block outputs on the first `search_windows` calibration windows (2 x 512 tokens by
default, for CPU time; the reference implementation uses 128 x 512 on a GPU); mean |x| is over all windows.
Layers run in order; each layer's calibration inputs are the float outputs of the layer before (scaled, not
quantized, as the reference implementation). Weight clipping (awq.search_clip) covers every projection but q and
k (whose errors the softmax amplifies; the reference implementation skips them too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from loom.quant.awq import SCALINGS, apply_clip, awq_quantize, search_clip, search_scales
from loom.quant.gptq import GPTQWeight

logger = logging.getLogger(__name__)

CLIP_TOKENS = 512  # calibration tokens the clipping search reads (evenly spaced), as the reference implementation


@dataclass(frozen=True, slots=True)
class AWQSettings:
    """What `loom quantize --method awq` does."""

    group_size: int = 128  # input columns per scale (32, 64 or 128; a last group may be shorter)
    clip: bool = True  # search per-group clipping after the scales
    grid_points: int = 20  # alphas i / grid_points
    search_windows: int = 2  # calibration windows whose block outputs the search compares (all give mean |x|)
    scaling: str = "both"  # the scale formulas searched: "activation", "duo" or "both" (awq.search_scales)

    def check(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128 for AWQ, got {self.group_size}")
        if self.search_windows < 1:
            raise ValueError(f"search_windows must be >= 1, got {self.search_windows}")
        if self.grid_points < 1:
            raise ValueError(f"grid_points must be >= 1, got {self.grid_points}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")


@dataclass(slots=True)
class AWQReport:
    """What the search chose (for the log and the config's meta)."""

    alphas: dict[str, float] = field(default_factory=dict)  # loom layer name -> chosen alpha
    duo: dict[str, bool] = field(default_factory=dict)  # loom layer name -> whether duo scaling's formula won
    o_proj_scaled: bool = False  # whether o_proj had scales (v_proj and o_proj of one shape)


class _Windows:
    """Per calibration window: positions' rotary tables, a one-layer paged cache and its metadata, so a layer or
    its attention can be re-run on cached inputs."""

    def __init__(self, model: torch.nn.Module, arch: Any, lengths: list[int]) -> None:
        from loom.attention import build_attention_metadata
        from loom.worker.kv_cache import allocate_kv_caches

        block = 16
        self.items = []
        for n in lengths:
            blocks = -(-n // block)
            cache = allocate_kv_caches(arch, blocks, block, torch.float32, torch.device("cpu"))[0]
            meta = build_attention_metadata([n], [n], [list(range(blocks))], block, torch.device("cpu"))
            self.items.append((model.model.rotary_emb.cos_sin(torch.arange(n)), cache, meta))


def _capture(layer: torch.nn.Module, windows: _Windows, states: list[tuple[torch.Tensor, Any]],
             ) -> tuple[dict[str, list[torch.Tensor]], list[tuple[torch.Tensor, Any]]]:
    """Run the layer on every window; returns (its four linears' inputs per window, the layer's outputs)."""
    feats: dict[str, list[torch.Tensor]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    handles = [m.register_forward_pre_hook(lambda _m, args, key=key: feats[key].append(args[0].detach().clone()))
               for key, m in mods.items()]
    out = []
    try:
        for (hidden, residual), (cos_sin, cache, meta) in zip(states, windows.items, strict=True):
            out.append(layer(hidden, residual, cos_sin, cache, meta))
    finally:
        for h in handles:
            h.remove()
    return feats, out


class _SwapWeight:
    """Temporarily give a linear another weight (the block functions run the real modules)."""

    def __init__(self, lin: torch.nn.Module, weight: torch.Tensor) -> None:
        self.lin, self.weight = lin, weight

    def __enter__(self) -> None:
        self.saved = self.lin.weight.data
        self.lin.weight.data = self.weight

    def __exit__(self, *exc: object) -> None:
        self.lin.weight.data = self.saved


def fold_qkv(layer: torch.nn.Module, s: torch.Tensor) -> None:
    """q/k/v columns * s, input_layernorm.weight / s (the product is unchanged before rounding)."""
    layer.input_layernorm.weight.data.div_(s)
    layer.self_attn.qkv_proj.weight.data.mul_(s)


def fold_o(layer: torch.nn.Module, arch: Any, s: torch.Tensor) -> None:
    """o_proj columns * s, v_proj rows (and bias) / s: attention is linear in V. Needs kv_size == q_size."""
    qkv = layer.self_attn.qkv_proj
    v = slice(arch.q_size + arch.kv_size, arch.q_size + 2 * arch.kv_size)
    qkv.weight.data[v].div_(s[:, None])
    if qkv.bias is not None:
        qkv.bias.data[v].div_(s)
    layer.self_attn.o_proj.weight.data.mul_(s)


def fold_gate_up(layer: torch.nn.Module, s: torch.Tensor) -> None:
    """gate/up columns * s, post_attention_layernorm.weight / s."""
    layer.post_attention_layernorm.weight.data.div_(s)
    layer.mlp.gate_up_proj.weight.data.mul_(s)


def fold_down(layer: torch.nn.Module, arch: Any, s: torch.Tensor) -> None:
    """down_proj columns * s, up_proj rows / s: silu(gate) * up is linear in up."""
    layer.mlp.gate_up_proj.weight.data[arch.intermediate_size:].div_(s[:, None])
    layer.mlp.down_proj.weight.data.mul_(s)


def scale_layer(layer: torch.nn.Module, arch: Any, windows: _Windows, feats: dict[str, list[torch.Tensor]],
                settings: AWQSettings, name: str, report: AWQReport) -> dict[str, torch.Tensor]:
    """Search and fold the four groups' scales of one layer (module table); returns each linear's calibration
    input as it is after the folding, rows of all windows stacked."""
    attn, mlp = layer.self_attn, layer.mlp
    xs = {key: torch.cat(v) for key, v in feats.items()}
    n = settings.search_windows
    search = {key: torch.cat(v[:n]) for key, v in feats.items()}  # the search's tokens (CPU time)

    def attn_block(ws: list[torch.Tensor]) -> torch.Tensor:
        with _SwapWeight(attn.qkv_proj, ws[0]):
            return torch.cat([attn(x, cos_sin, cache, meta)
                              for x, (cos_sin, cache, meta) in zip(feats["qkv"][:n], windows.items[:n])])

    def mlp_block(ws: list[torch.Tensor]) -> torch.Tensor:
        with _SwapWeight(mlp.gate_up_proj, ws[0]):
            return mlp(search["gate_up"])

    def linear_block(key: str) -> Any:
        return lambda ws: search[key] @ ws[0].T

    groups = [("qkv", attn.qkv_proj, attn_block, lambda s: fold_qkv(layer, s))]
    if arch.kv_size == arch.q_size:
        groups.append(("o", attn.o_proj, linear_block("o"), lambda s: fold_o(layer, arch, s)))
        report.o_proj_scaled = True
    groups += [("gate_up", mlp.gate_up_proj, mlp_block, lambda s: fold_gate_up(layer, s)),
               ("down", mlp.down_proj, linear_block("down"), lambda s: fold_down(layer, arch, s))]
    with torch.no_grad():
        for key, lin, block, fold in groups:
            s, alpha, duo, _ = search_scales(xs[key].abs().mean(dim=0), [lin.weight.data.float()], block,
                                             settings.group_size, settings.grid_points, settings.scaling)
            fold(s)
            xs[key] = xs[key] / s
            search[key] = search[key] / s
            report.alphas[f"{name}.{key}"] = alpha
            report.duo[f"{name}.{key}"] = duo
    return xs


def clip_layer(layer: torch.nn.Module, arch: Any, xs: dict[str, torch.Tensor], group_size: int) -> None:
    """AWQ's weight clipping (awq.search_clip) on every projection but q and k, in place."""
    lins = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    with torch.no_grad():
        for key, lin in lins.items():
            x = xs[key]
            x = x[torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()]
            w = lin.weight.data
            rows = slice(arch.q_size + arch.kv_size, None) if key == "qkv" else slice(None)
            w[rows] = apply_clip(w[rows], search_clip(w[rows], x, group_size), group_size)


def quantize_model_awq(model: torch.nn.Module, arch: Any, settings: AWQSettings, windows: list[list[int]],
                       ) -> tuple[dict[str, GPTQWeight], AWQReport]:
    """AWQ over every decoder layer of a dense float32 loom model (quantization "none"), in place: the scales
    folded (norm weights and v / up rows change), weights clipped, and each linear's weight replaced by its
    dequantized 4-bit values.

    Returns:
        (loom layer name ("model.layers.0.self_attn.qkv_proj", ...) -> its GPTQWeight (stacked rows, AWQ grid),
         what the search chose).

    Raises:
        ValueError: no calibration window, or bad settings.
    """
    settings.check()
    if not windows:
        raise ValueError("awq needs at least one calibration window")
    report = AWQReport()
    ctx = _Windows(model, arch, [len(w) for w in windows])
    with torch.no_grad():
        states = [(model.model.embed_tokens(torch.tensor(w)), None) for w in windows]
    out: dict[str, GPTQWeight] = {}
    for i, layer in enumerate(tqdm(model.model.layers, desc="awq", unit="layer")):
        with torch.no_grad():
            feats, states = _capture(layer, ctx, states)
        name = f"model.layers.{i}"
        xs = scale_layer(layer, arch, ctx, feats, settings, name, report)
        del feats
        if settings.clip:
            clip_layer(layer, arch, xs, settings.group_size)
        for parent, lin_name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                                 ("mlp", "down_proj")):
            lin = getattr(getattr(layer, parent), lin_name)
            q = awq_quantize(lin.weight.data, settings.group_size)
            lin.weight.data.copy_(q.dequantize())
            out[f"{name}.{parent}.{lin_name}"] = q
    return out, report
