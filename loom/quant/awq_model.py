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

Clipping ("on" in the reference implementation) is chosen per projection type by default (AWQSettings.clip
"auto"): the clip search minimises each linear's own output error on 512 tokens, which on some models costs the
rare tokens that perplexity counts (on Qwen2.5-Coder-0.5B clipping gate/up alone doubled AWQ's perplexity loss;
benchmarks/BENCHMARKS.md). Because later layers' calibration inputs come from float layers, the clip decisions
change no search, so after the last layer the model is scored, whole, on calibration windows the scale search did
not read: every type unclipped, each type clipped alone, the types that helped alone clipped together, and all
four clipped. The candidate closest to the unquantized model (KL) wins among those whose next-token negative
log-likelihood is no higher than without clipping (select_clip).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from loom.quant.awq import SCALINGS, apply_clip, awq_quantize, normalized_loss, search_clip, search_scales
from loom.quant.gptq import GPTQWeight

logger = logging.getLogger(__name__)

CLIP_TOKENS = 512  # calibration tokens the clipping search reads (evenly spaced), as the reference implementation
CLIPS = ("auto", "on", "off")  # AWQSettings.clip
LOSSES = ("mse", "normalized")  # AWQSettings.loss
CLIP_TYPES = ("qkv", "o", "gate_up", "down")  # the projection types clipping is chosen for ("qkv": v's rows only)


@dataclass(frozen=True, slots=True)
class AWQSettings:
    """What `loom quantize --method awq` does."""

    group_size: int = 128  # input columns per scale (32, 64 or 128; a last group may be shorter)
    clip: str = "auto"  # per-group weight clipping after the scales: "on", "off", or "auto" (chosen per type)
    grid_points: int = 20  # alphas i / grid_points
    search_windows: int = 2  # calibration windows whose block outputs the search compares (all give mean |x|)
    scaling: str = "both"  # the scale formulas searched: "activation", "duo" or "both" (awq.search_scales)
    loss: str = "normalized"  # the scale search's block error: "normalized" (per output channel) or "mse" (the paper's)

    def check(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128 for AWQ, got {self.group_size}")
        if self.search_windows < 1:
            raise ValueError(f"search_windows must be >= 1, got {self.search_windows}")
        if self.grid_points < 1:
            raise ValueError(f"grid_points must be >= 1, got {self.grid_points}")
        if self.clip not in CLIPS:
            raise ValueError(f"clip must be one of {', '.join(CLIPS)}, got {self.clip!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")


class ClipScore(NamedTuple):
    """A clipping candidate's model on the held-out calibration windows."""

    nll: float  # mean next-token negative log-likelihood (nats)
    kl: float  # mean KL(unquantized model || this one) over positions (nats)


@dataclass(slots=True)
class AWQReport:
    """What the search chose (for the log and the config's meta)."""

    alphas: dict[str, float] = field(default_factory=dict)  # loom layer name -> chosen alpha
    duo: dict[str, bool] = field(default_factory=dict)  # loom layer name -> whether duo scaling's formula won
    o_proj_scaled: bool = False  # whether o_proj had scales (v_proj and o_proj of one shape)
    clipped: tuple[str, ...] = ()  # the projection types (CLIP_TYPES) whose weights were clipped
    clip_scores: dict[str, ClipScore] = field(default_factory=dict)  # "auto": candidate ("none", "o", "qkv+down",
    # "all") -> its model on the clip_windows calibration windows
    clip_windows: int = 0  # "auto": how many calibration windows scored the candidates
    clip_held_out: bool = False  # "auto": whether the scale search did not read them (fewer windows: it did)


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
    handles = [m.register_forward_pre_hook(lambda _m, args, key=key: feats[key].append(args[0].detach().clone()))
               for key, m in _linears(layer).items()]
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

    def loss(block: Any) -> Any:
        return normalized_loss(block) if settings.loss == "normalized" else block

    groups = [("qkv", attn.qkv_proj, loss(attn_block), lambda s: fold_qkv(layer, s))]
    if arch.kv_size == arch.q_size:
        groups.append(("o", attn.o_proj, loss(linear_block("o")), lambda s: fold_o(layer, arch, s)))
        report.o_proj_scaled = True
    groups += [("gate_up", mlp.gate_up_proj, loss(mlp_block), lambda s: fold_gate_up(layer, s)),
               ("down", mlp.down_proj, loss(linear_block("down")), lambda s: fold_down(layer, arch, s))]
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


def _linears(layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}


def _clip_rows(key: str, arch: Any) -> slice:
    """The rows clipping touches: all but q and k."""
    return slice(arch.q_size + arch.kv_size, None) if key == "qkv" else slice(None)


def search_layer_clip(layer: torch.nn.Module, arch: Any, xs: dict[str, torch.Tensor], group_size: int,
                      ) -> dict[str, torch.Tensor]:
    """AWQ's weight-clipping search (awq.search_clip) for each projection type of one layer, on CLIP_TOKENS of its
    inputs `xs` (evenly spaced); returns type -> float32 bounds [rows clipped, groups] (nothing is changed)."""
    bounds = {}
    with torch.no_grad():
        for key, lin in _linears(layer).items():
            x = xs[key]
            x = x[torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()]
            bounds[key] = search_clip(lin.weight.data[_clip_rows(key, arch)], x, group_size)
    return bounds


def _quantize_layer(layer: torch.nn.Module, arch: Any, weights: dict[str, torch.Tensor],
                    bounds: dict[str, torch.Tensor], clipped: tuple[str, ...], group_size: int,
                    ) -> dict[str, GPTQWeight]:
    """Set each linear of `layer` to the 4-bit values of its float `weights` (those of the `clipped` types
    clipped to `bounds` first); returns type -> GPTQWeight."""
    out = {}
    with torch.no_grad():
        for key, lin in _linears(layer).items():
            w = weights[key]
            if key in clipped:
                w = w.clone()
                rows = _clip_rows(key, arch)
                w[rows] = apply_clip(w[rows], bounds[key], group_size)
            q = awq_quantize(w, group_size)
            lin.weight.data.copy_(q.dequantize())
            out[key] = q
    return out


def log_probs(model: torch.nn.Module, arch: Any, windows: list[list[int]]) -> list[torch.Tensor]:
    """Per window, the model's next-token log-probabilities, float32 [len(window), vocab], each window one prefill."""
    from loom.bench.quality import window_logits

    with torch.no_grad():
        return [torch.log_softmax(window_logits(model, arch, tokens), dim=-1) for tokens in windows]


def _score(model: torch.nn.Module, arch: Any, windows: list[list[int]], reference: list[torch.Tensor]) -> ClipScore:
    nll, kl, positions = 0.0, 0.0, 0
    for tokens, ref, lq in zip(windows, reference, log_probs(model, arch, windows), strict=True):
        ref, lq = ref.double(), lq.double()
        kl += float((ref.exp() * (ref - lq)).sum())
        nll -= float(lq[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).sum())
        positions += len(tokens)
    return ClipScore(nll / (positions - len(windows)), kl / positions)


def select_clip(model: torch.nn.Module, arch: Any, layers: list[tuple[torch.nn.Module, dict[str, torch.Tensor],
                dict[str, torch.Tensor]]], windows: list[list[int]], reference: list[torch.Tensor],
                group_size: int) -> tuple[tuple[str, ...], dict[str, ClipScore]]:
    """Choose which projection types to clip by the whole quantized model on held-out calibration windows: the
    candidate closest to the unquantized model (lowest KL) among those whose NLL is no higher than with no clipping
    (clipping that brings the model's top choices closer can still take probability from rarer tokens, which
    perplexity counts: BENCHMARKS.md, "why AWQ loses to RTN on Qwen").

    Args:
        layers: per decoder layer (module, type -> its scaled float weight, type -> its clip bounds).
        windows: held-out calibration token ids (not read by the scale search), each of 2 tokens or more.
        reference: log_probs of the unquantized model on `windows`.
    Returns:
        (the chosen types in CLIP_TYPES order, candidate name -> ClipScore): candidates are none, each type alone,
        the types that improved on none alone (both measures; when two or more), and all four; ties go to the
        earlier candidate.
    The layers' weights are left at the 4-bit values of the last candidate scored.
    """
    scores: dict[tuple[str, ...], ClipScore] = {}

    def score(clipped: tuple[str, ...]) -> ClipScore:
        for layer, weights, bounds in layers:
            _quantize_layer(layer, arch, weights, bounds, clipped, group_size)
        scores[clipped] = _score(model, arch, windows, reference)
        logger.info("awq clip %s: calibration NLL %.5f, KL %.5f", "+".join(clipped) or "none",
                    *scores[clipped])
        return scores[clipped]

    base = score(())
    helped = []
    for key in CLIP_TYPES:
        one = score((key,))
        if one.kl < base.kl and one.nll <= base.nll:
            helped.append(key)
    for combo in (tuple(helped), CLIP_TYPES):
        if combo not in scores:
            score(combo)
    eligible = [c for c in scores if scores[c].nll <= base.nll]  # insertion order: ties go to the earlier
    best = min(eligible, key=lambda c: scores[c].kl)
    names = {c: ("all" if c == CLIP_TYPES else "+".join(c) or "none") for c in scores}
    return best, {names[c]: v for c, v in scores.items()}


_NAMES = (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"), ("gate_up", "mlp.gate_up_proj"),
          ("down", "mlp.down_proj"))  # AWQ's linear types -> loom's layer names under model.layers.i


def quantize_model_awq(model: torch.nn.Module, arch: Any, settings: AWQSettings, windows: list[list[int]],
                       float_weights: dict[str, torch.Tensor] | None = None,
                       ) -> tuple[dict[str, GPTQWeight], AWQReport]:
    """AWQ over every decoder layer of a dense float32 loom model (quantization "none"), in place: the scales
    folded (norm weights and v / up rows change), weights clipped (settings.clip; "auto" scores the model on
    windows[settings.search_windows:], or on every window when none is left), and each linear's weight replaced
    by its dequantized 4-bit values. With `float_weights` (a dict), each linear's scaled float32 weight before
    clipping and rounding is stored in it under the layer's name (what mixed precision quantizes otherwise).

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
    if settings.clip == "auto":
        held_out = [w for w in windows[settings.search_windows:] if len(w) > 1]
        report.clip_held_out = bool(held_out)
        if not held_out:
            held_out = [w for w in windows if len(w) > 1]
            if not held_out:
                raise ValueError("awq clip 'auto' needs a calibration window of 2 tokens or more")
            logger.warning("awq clip auto: the scale search reads every calibration window; clipping is chosen on "
                           "those same windows, not held-out ones (give more than %d calibration windows to hold "
                           "some out)", settings.search_windows)
        report.clip_windows = len(held_out)
        reference = log_probs(model, arch, held_out)  # the unquantized model's
    ctx = _Windows(model, arch, [len(w) for w in windows])
    with torch.no_grad():
        states = [(model.model.embed_tokens(torch.tensor(w)), None) for w in windows]
    clipped = {"on": CLIP_TYPES, "off": (), "auto": ()}[settings.clip]
    pending = []  # "auto": per layer (module, scaled float weights, clip bounds), quantized once clipping is chosen
    out: dict[str, GPTQWeight] = {}

    def keep(i: int, qs: dict[str, GPTQWeight]) -> None:
        for key, lin_name in _NAMES:
            out[f"model.layers.{i}.{lin_name}"] = qs[key]

    for i, layer in enumerate(tqdm(model.model.layers, desc="awq", unit="layer")):
        with torch.no_grad():
            feats, states = _capture(layer, ctx, states)
        xs = scale_layer(layer, arch, ctx, feats, settings, f"model.layers.{i}", report)
        del feats
        bounds = search_layer_clip(layer, arch, xs, settings.group_size) if settings.clip != "off" else {}
        weights = {key: lin.weight.data for key, lin in _linears(layer).items()}
        if float_weights is not None:
            for key, lin_name in _NAMES:
                float_weights[f"model.layers.{i}.{lin_name}"] = weights[key].clone()
        if settings.clip == "auto":
            pending.append((layer, {k: w.clone() for k, w in weights.items()}, bounds))
        else:
            keep(i, _quantize_layer(layer, arch, weights, bounds, clipped, settings.group_size))
    if pending:
        clipped, report.clip_scores = select_clip(model, arch, pending, held_out, reference, settings.group_size)
        logger.info("awq clip auto: clipping %s (scored on %d %s calibration windows)", "+".join(clipped) or "no type",
                    report.clip_windows, "held-out" if report.clip_held_out else "searched")
        for i, (layer, weights, bounds) in enumerate(pending):
            keep(i, _quantize_layer(layer, arch, weights, bounds, clipped, settings.group_size))
    report.clipped = clipped
    return out, report
