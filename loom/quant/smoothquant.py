"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438): move activation outliers into the weights before W8A8.

Per-token int8 activations lose most where a few input channels are much larger than the rest: the row's one
scale is set by the outlier and the other channels keep a few levels each. SmoothQuant divides input channel j
of a linear layer's activations by s_j and multiplies column j of its weight by s_j, which leaves the product
unchanged before rounding, with

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(max|X_j| over calibration tokens, max|W_j| over every weight row that reads channel j; alpha, the migration
strength, 0.5 by default). The division is folded into the op that produces X, so nothing runs at inference:

| layers reading X        | X comes from                  | folded into                                      |
|-------------------------|-------------------------------|--------------------------------------------------|
| q_proj, k_proj, v_proj  | input_layernorm               | the norm's weight (one s for all three)          |
| gate_proj, up_proj      | post_attention_layernorm      | the norm's weight (one s for both)               |
| o_proj                  | attention: softmax(.) @ V     | v_proj's rows (and bias): attention is linear in V |
| down_proj               | silu(gate) * up               | up_proj's rows: the product is linear in up      |

With grouped-query attention a V channel feeds one o_proj column per query head of its group, so those columns
share one s (the max of their statistics). Weights are Hugging Face-named float tensors (loom/model/llama.py
stacks them only at load), so the result is an ordinary checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from loom.model.arch import ModelArchConfig
from loom.quant.hadamard import rotate, rotation_block
from loom.quant.layout import dequantize
from loom.quant.rtn import quantize_q8

# loom's stacked layers whose input statistics calibration records
SMOOTHED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@torch.inference_mode()
def collect_input_absmax(model: torch.nn.Module, arch: ModelArchConfig,
                         windows: Iterable[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| over every calibration token of each smoothed layer's input, per input channel.

    Args:
        model: a loom model loaded with quantization "none" (dense weights; float32 for exact statistics).
        arch: its architecture.
        windows: token-id sequences, each run as one prefill (loom.bench.quality.window_logits).

    Returns:
        loom layer name (e.g. "model.layers.0.self_attn.qkv_proj") -> float32 [input_size].
    """
    stats: dict[str, torch.Tensor] = {}

    def hook_for(name: str, _module: torch.nn.Module) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, args: tuple) -> None:
            amax = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(dim=0)
            stats[name] = amax if name not in stats else torch.maximum(stats[name], amax)
        return hook

    _run_with_input_hooks(model, arch, windows, hook_for)
    if not stats:
        raise ValueError("no smoothable layer (qkv_proj, o_proj, gate_up_proj, down_proj) saw a calibration token")
    return stats


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act_absmax ** alpha / weight_absmax ** (1 - alpha), float32 [channels] (SmoothQuant eq. 4).

    Channels that calibration never saw non-zero, or whose weights are all zero, get s = 1.

    Raises:
        ValueError: alpha outside [0, 1], or shapes that differ.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if act_absmax.shape != weight_absmax.shape:
        raise ValueError(f"activation statistics {tuple(act_absmax.shape)} != weight statistics "
                         f"{tuple(weight_absmax.shape)}")
    act, wt = act_absmax.float(), weight_absmax.float()
    s = act.pow(alpha) / wt.pow(1.0 - alpha)
    ok = (act > 0) & (wt > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(min=1e-5)


@torch.no_grad()
def smooth_weights(weights: dict[str, torch.Tensor], act_absmax: dict[str, torch.Tensor], arch: ModelArchConfig,
                   alpha: float | Mapping[str, float] = 0.5) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant's scales into a Llama-family checkpoint (the table above); returns new float32 tensors
    for the changed names, the others as given.

    Args:
        weights: Hugging Face name -> dense tensor ("model.layers.{i}.self_attn.q_proj.weight", ...).
        act_absmax: collect_input_absmax's statistics (loom layer names).
        arch: the model's architecture (heads, for grouped-query attention).
        alpha: migration strength in [0, 1], one for every layer or per loom layer name (search_alpha's
            answer; a layer it lacks takes 0.5).

    Raises:
        ValueError: a layer without statistics or a weight, or alpha out of range.
    """
    out = dict(weights)

    def get(name: str) -> torch.Tensor:
        if name not in out:
            raise ValueError(f"checkpoint has no tensor {name!r} to smooth")
        return out[name].float().clone()

    def stat(name: str) -> torch.Tensor:
        if name not in act_absmax:
            raise ValueError(f"no calibration statistics for {name!r}")
        return act_absmax[name].float()

    def alpha_of(name: str) -> float:
        return alpha if isinstance(alpha, (int, float)) else alpha.get(name, 0.5)

    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        # q/k/v read input_layernorm's output
        norm = get(f"{p}.input_layernorm.weight")
        qkv = [get(f"{p}.self_attn.{n}_proj.weight") for n in "qkv"]
        s = smoothing_factors(stat(f"{p}.self_attn.qkv_proj"), torch.cat(qkv).abs().amax(dim=0),
                              alpha_of(f"{p}.self_attn.qkv_proj"))
        out[f"{p}.input_layernorm.weight"] = norm / s
        for n, w in zip("qkv", qkv, strict=True):
            out[f"{p}.self_attn.{n}_proj.weight"] = w * s
        # gate/up read post_attention_layernorm's output
        norm = get(f"{p}.post_attention_layernorm.weight")
        gate, up = get(f"{p}.mlp.gate_proj.weight"), get(f"{p}.mlp.up_proj.weight")
        s = smoothing_factors(stat(f"{p}.mlp.gate_up_proj"), torch.cat([gate, up]).abs().amax(dim=0),
                              alpha_of(f"{p}.mlp.gate_up_proj"))
        out[f"{p}.post_attention_layernorm.weight"] = norm / s
        out[f"{p}.mlp.gate_proj.weight"], up = gate * s, up * s
        # down reads silu(gate) * up: divide up's rows (after its own smoothing above)
        down = get(f"{p}.mlp.down_proj.weight")
        s = smoothing_factors(stat(f"{p}.mlp.down_proj"), down.abs().amax(dim=0), alpha_of(f"{p}.mlp.down_proj"))
        out[f"{p}.mlp.up_proj.weight"] = up / s[:, None]
        out[f"{p}.mlp.down_proj.weight"] = down * s
        # o reads attention's output, linear in V: divide v's rows; a V channel serves its group's query heads
        o = get(f"{p}.self_attn.o_proj.weight")
        s_v = _v_scales(stat(f"{p}.self_attn.o_proj"), o, arch, alpha_of(f"{p}.self_attn.o_proj"))
        v_name = f"{p}.self_attn.v_proj"
        out[f"{v_name}.weight"] = out[f"{v_name}.weight"] / s_v[:, None]
        if f"{v_name}.bias" in out:
            out[f"{v_name}.bias"] = get(f"{v_name}.bias") / s_v
        out[f"{p}.self_attn.o_proj.weight"] = o * _o_scales(s_v, arch)
    return out


def _run_with_input_hooks(model: torch.nn.Module, arch: ModelArchConfig, windows: Iterable[list[int]],
                          hook_for: Callable[[str, torch.nn.Module], Callable[..., None] | None]) -> None:
    """Run each window as one prefill with `hook_for(name, module)`'s forward pre-hook (None: none) on every
    smoothed layer; the hooks are removed afterwards, whatever happens."""
    from loom.bench.quality import window_logits

    handles = []
    try:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in SMOOTHED_LAYERS:
                hook = hook_for(name, module)
                if hook is not None:
                    handles.append(module.register_forward_pre_hook(hook))
        for tokens in windows:
            window_logits(model, arch, tokens)
    finally:
        for handle in handles:
            handle.remove()


def _fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 round trip of x [R, K]: w8a8's activation grid (float32 scale max|x| / 127)."""
    s = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(s > 0, (x / s.clamp_min(1e-30)).round().clamp(-127, 127), torch.zeros_like(x))
    return q * s


def _v_scales(act: torch.Tensor, o_weight: torch.Tensor, arch: ModelArchConfig, alpha: float) -> torch.Tensor:
    """o_proj's smoothing factors per V channel [kv_size]: one V channel feeds one o_proj column per query head of
    its group, so the group's statistics (act [q_size], o_weight [hidden, q_size]) are maxed together."""
    kv, rep, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    return smoothing_factors(act.float().reshape(kv, rep, d).amax(dim=1).reshape(-1),
                             o_weight.abs().amax(dim=0).float().reshape(kv, rep, d).amax(dim=1).reshape(-1), alpha)


def _o_scales(s_v: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    """The V-channel factors [kv_size] spread over o_proj's input columns [q_size]."""
    kv, rep, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    return s_v.reshape(kv, 1, d).expand(kv, rep, d).reshape(-1)


def _layer_scales(name: str, act: torch.Tensor, weight: torch.Tensor, arch: ModelArchConfig,
                  alpha: float) -> torch.Tensor:
    """The s [input_size] smooth_weights would give the loom layer `name` (weight [N, K], its dense weight)."""
    if name.endswith("o_proj"):
        return _o_scales(_v_scales(act, weight, arch, alpha), arch)
    return smoothing_factors(act, weight.abs().amax(dim=0).float(), alpha)


ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@torch.inference_mode()
def search_alpha(model: torch.nn.Module, arch: ModelArchConfig, windows: Iterable[list[int]],
                 act_absmax: dict[str, torch.Tensor], grid: Iterable[float] = ALPHA_GRID,
                 weight_group: int | None = None, rotated: bool = True) -> dict[str, float]:
    """Per layer, the alpha of `grid` whose W8A8 output is closest to the float output on calibration tokens.

    For each smoothed layer and alpha: Y = X W^T (float) against Q(R(X / s)) Q(R(W s))^T, with per-token
    int8 X, symmetric int8 W in groups of `weight_group` columns (None: per output channel) and R the block
    Hadamard rotation of loom's w8a8 (identity when not `rotated`); the squared error is summed over the
    windows. Defaults: loom's w8a8 (loom/quant/methods.py). SmoothQuant picks one alpha per model; choosing
    per layer by the layer's own output error is the search AWQ (Lin et al. 2023, arXiv:2306.00978) runs for its scales, applied to SmoothQuant's family.

    Args:
        model: the dense float model the statistics came from (quantization "none").
        windows: calibration token windows (the same as for collect_input_absmax, or others).
        act_absmax: collect_input_absmax's statistics.
        grid: alphas tried, each in [0, 1].
        weight_group: columns per weight scale; None = one per output channel.

    Returns:
        loom layer name -> the best alpha.
    """
    grid = tuple(grid)
    errors: dict[str, torch.Tensor] = {}

    def hook_for(name: str, module: torch.nn.Module) -> Callable[..., None] | None:
        if name not in act_absmax:
            return None
        weight = module.weight.detach().float()
        group = weight.shape[1] if weight_group is None else weight_group
        block = rotation_block(weight.shape[1]) if rotated else 1
        quantized = []  # (s, Q(R(W s))) per alpha, built once per layer: the kernel's own int8 grid
        for a in grid:
            scales = _layer_scales(name, act_absmax[name], weight, arch, a)
            quantized.append((scales, dequantize(quantize_q8(rotate(weight * scales, block), group))))

        def hook(_m: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().float().reshape(-1, weight.shape[1])
            y = x @ weight.T
            err = torch.stack([((_fake_quant_tokens(rotate(x / sc, block)) @ wq.T) - y).square().sum()
                               for sc, wq in quantized])
            errors[name] = err if name not in errors else errors[name] + err
        return hook

    _run_with_input_hooks(model, arch, windows, hook_for)
    return {name: grid[int(err.argmin())] for name, err in errors.items()}
