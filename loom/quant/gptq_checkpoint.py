"""`loom quantize --method rtn|gptq`: a Hugging Face GPTQ-format checkpoint from a GGUF file or HF directory.

RTN rounds every linear weight to the nearest point of the GPTQ grid (loom/quant/gptq.py). GPTQ (Frantar et al.
2022, arXiv:2210.17323) quantizes the decoder layers one after another, as the paper does: the calibration
windows' hidden states enter layer 0; within a layer the four linear groups (q/k/v, o, gate/up, down; q/k/v and
gate/up share an input and so one Hessian) are quantized in order, each from the inputs it sees with the
groups before it already quantized ("true sequential"); the layer's outputs, computed with its quantized
weights, are the next layer's inputs. Embeddings, norms and the LM head stay in float32.

The checkpoint (loom/quant/gptq_format.py) is checkpoint_format "gptq" (v1), the layout AutoGPTQ, GPTQModel and
transformers read; loom loads it with `--quantization gptq`, its default for such a checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loom.quant.gptq import GPTQWeight, accumulate_hessian, gptq_quantize, rtn_quantize

logger = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128, -1)
LINEAR_GROUPS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
# loom layer -> the checkpoint projections stacked in it
PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LINEAR_NAMES = tuple(p for group in PROJECTIONS.values() for p in group)  # the checkpoint's projection names

# The GPTQModel `dynamic` rule giving the LM head its own bits ("+:" = a regex that includes the module)
LM_HEAD_RULE = "+:lm_head"


@dataclass(frozen=True, slots=True)
class GPTQSettings:
    """What to quantize to (the quantization_config written)."""

    method: str  # "rtn" or "gptq"
    bits: int  # 4 or 8
    group_size: int  # input columns per scale; -1 = per output channel
    sym: bool  # symmetric grid (zero = 2^(bits-1)); else asymmetric
    desc_act: bool  # GPTQ act-order: columns by decreasing Hessian diagonal (gptq only)
    damp_percent: float = 0.01  # GPTQ dampening, times the Hessian's mean diagonal
    block_size: int = 128  # GPTQ lazy-batch columns
    target_bits: float | None = None  # mixed precision: stored bits per weight of the linear layers (mixed.py)
    dynamic: dict[str, dict[str, Any]] | None = None  # per-module overrides (GPTQModel's form), ahead of the plan
    sensitivity_windows: int = 1  # calibration windows the sensitivity is measured on (mixed precision)
    static_groups: bool = False  # with desc_act: group parameters over consecutive columns, fixed first (gptq.py)
    # the LM head by RTN at this many bits (the settings' group size and grid), written as GPTQModel's lm_head: true;
    # None = kept dense, as AutoGPTQ and GPTQModel write by default (a tied embedding then stays one float matrix)
    lm_head_bits: int | None = None

    def check(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.method not in ("rtn", "gptq"):
            raise ValueError(f"method must be 'rtn' or 'gptq', got {self.method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.desc_act and self.method != "gptq":
            raise ValueError("desc_act (act-order) applies to method 'gptq' only")
        if self.static_groups and not self.desc_act:
            raise ValueError("static_groups applies with desc_act (act-order) only")
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.target_bits is not None and not 2.0 <= self.target_bits <= 16.0:
            raise ValueError(f"target_bits must be in [2, 16], got {self.target_bits}")
        if self.lm_head_bits not in (None, 4, 8):
            raise ValueError(f"lm_head_bits must be 4 or 8, got {self.lm_head_bits}")
        if self.sensitivity_windows < 1:
            raise ValueError(f"sensitivity_windows must be >= 1, got {self.sensitivity_windows}")
        if self.dynamic is not None:
            from loom.quant.gptq_method import read_dynamic

            for negative, _pattern, overrides in read_dynamic(self.dynamic):
                group = overrides.get("group_size", self.group_size)
                if not negative and group not in GROUP_SIZES:
                    raise ValueError(f"dynamic: group_size must be one of {GROUP_SIZES}, got {group!r}")
                unknown = set(overrides) - {"bits", "group_size"}
                if unknown:
                    raise ValueError(f"dynamic: loom quantize overrides bits and group_size only, got "
                                     f"{sorted(unknown)}")

    def quantization_config(self, calibration: str, tokens: int,
                            dynamic: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """config.json's quantization_config (the keys transformers' GPTQConfig and GPTQModel read; the format
        under both its current name, "format", and the legacy "checkpoint_format"), with `dynamic` when some
        modules differ from the base settings."""
        config = {
            "quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
            "sym": self.sym, "damp_percent": self.damp_percent, "true_sequential": True,
            "static_groups": self.static_groups,
            "act_group_aware": False, "lm_head": self.lm_head_bits is not None, "format": "gptq",
            "checkpoint_format": "gptq",
            "model_file_base_name": "model",
            "meta": {"quantizer": ["loom"], "method": self.method, "calibration": calibration,
                     "calibration_tokens": tokens, "block_size": self.block_size},
        }
        if self.lm_head_bits is not None and self.lm_head_bits != self.bits:
            dynamic = {LM_HEAD_RULE: {"bits": self.lm_head_bits}, **(dynamic or {})}  # first: no decoder name matches
        if dynamic:
            config["dynamic"] = dynamic
        if self.target_bits is not None:
            config["meta"]["target_bits"] = self.target_bits
        return config

    def base_format(self) -> tuple[int, int]:
        return self.bits, self.group_size

    def format_of(self, projections: tuple[str, ...], name: str) -> tuple[int, int] | None | str:
        """The user's `dynamic` decision for one of loom's layers (its projections' module names and its own
        stacked name, "model.layers.0.self_attn.qkv_proj"): a format, None to keep it in 16 bits, or "free"
        when no pattern matches any of the names.

        Raises:
            ValueError: stacked projections given different precisions (they run as one matrix).
        """
        from loom.quant.gptq_method import read_dynamic

        rules = read_dynamic(self.dynamic)

        def decide(module: str) -> tuple[int, int] | None | str:
            for negative, pattern, overrides in rules:
                if pattern.match(module):
                    return None if negative else (int(overrides.get("bits", self.bits)),
                                                  int(overrides.get("group_size", self.group_size)))
            return "free"

        per_projection = [decide(m) for m in projections]
        chosen = {d for d in (*per_projection, decide(name)) if d != "free"}
        if not chosen:
            return "free"
        if len(chosen) > 1 or (chosen and "free" in per_projection and len(set(per_projection)) > 1):
            raise ValueError(f"dynamic: {list(projections)} run as one matrix and need one precision; the "
                             f"patterns give {sorted(map(str, per_projection))}")
        return chosen.pop()


def quantize_model_weights(model: torch.nn.Module, arch: Any, settings: GPTQSettings,
                           windows: list[list[int]],
                           plan: dict[str, tuple[int, int] | None] | None = None) -> dict[str, GPTQWeight]:
    """Quantize every decoder linear layer of a dense float32 loom model (quantization "none"), replacing its
    weight with the dequantized result as it goes (so later GPTQ layers see quantized inputs).

    Args:
        plan: loom layer name -> (bits, group_size), or None to leave that layer unquantized (mixed
            precision); layers it does not name take the settings' bits and group size.

    Returns:
        loom layer name ("model.layers.0.self_attn.qkv_proj", ...) -> its GPTQWeight (stacked rows), for the
        layers quantized.
    """
    settings.check()
    plan = plan or {}
    out: dict[str, GPTQWeight] = {}
    layers = model.model.layers
    gptq = settings.method == "gptq"
    if gptq and not windows:
        raise ValueError("gptq needs at least one calibration window")
    states = _embed(model, windows) if gptq else []
    for i, layer in enumerate(tqdm(layers, desc=settings.method, unit="layer")):
        for parent, name in LINEAR_GROUPS:
            unit = f"model.layers.{i}.{parent}.{name}"
            fmt = plan.get(unit, settings.base_format())
            if fmt is None:
                continue
            bits, group_size = fmt
            lin = getattr(getattr(layer, parent), name)
            if gptq:
                hessian = _layer_hessian(model, arch, layer, lin, states)
                q = gptq_quantize(lin.weight.data, hessian, bits, group_size, settings.sym,
                                  act_order=settings.desc_act, static_groups=settings.static_groups,
                                  percdamp=settings.damp_percent,
                                  block_size=settings.block_size)
            else:
                q = rtn_quantize(lin.weight.data, bits, group_size, settings.sym)
            lin.weight.data.copy_(q.dequantize())
            out[unit] = q
        if gptq:
            states = _run_layer(model, arch, layer, states)
    return out


def mixed_precision_plan(model: torch.nn.Module, arch: Any, settings: GPTQSettings, windows: list[list[int]],
                         ) -> tuple[dict[str, tuple[int, int] | None], dict[str, dict[str, Any]], float]:
    """Each decoder linear layer's format: the user's `dynamic` overrides first, then, with target_bits, the
    sensitivity-driven allocation of loom/quant/mixed.py over the others.

    Returns:
        (plan: loom layer name -> format or None for 16 bits, the `dynamic` map to write, stored bits per
        weight of the linear layers).

    Raises:
        ValueError: target_bits below what the overrides and the base format already take, or no window.
    """
    from loom.quant import mixed

    units = mixed.units_of(model)
    base = settings.base_format()
    fixed = {}
    for u in units:
        decision = settings.format_of(u.projections, u.name) if settings.dynamic else "free"
        if decision != "free":
            fixed[u.name] = decision
    if settings.dynamic:
        from loom.quant.gptq_method import read_dynamic

        names = [n for u in units for n in (*u.projections, u.name)]
        for key, (_negative, pattern, _overrides) in zip(settings.dynamic, read_dynamic(settings.dynamic)):
            if not any(pattern.match(n) for n in names):
                raise ValueError(f"dynamic: {key!r} matches none of the decoder's linear layers "
                                 f"(e.g. {units[0].projections[0]})")
    plan: dict[str, tuple[int, int] | None] = {u.name: base for u in units} | fixed
    free = [u for u in units if u.name not in fixed]
    if settings.target_bits is not None and free:
        # the budget is checked before the slow sensitivity trials
        total = sum(u.weights for u in units)
        fixed_bits = sum(mixed.unit_bits(u, plan[u.name]) for u in units if u.name in fixed)
        free_weights = sum(u.weights for u in free)
        target_free = (settings.target_bits * total - fixed_bits) / free_weights
        floor = sum(mixed.unit_bits(u, base) for u in free) / free_weights
        if target_free < floor - 1e-9:
            spent = " the layers dynamic sets leave" if fixed else ""
            raise ValueError(f"target_bits {settings.target_bits}:{spent} {target_free:.3f} bits per weight for "
                             f"the layers it allocates, below the {floor:.3f} of {base[0]}-bit groups of "
                             f"{base[1]} (codes, scales, zeros and g_idx)")
        if not windows:
            raise ValueError("target_bits needs calibration windows to measure each layer's sensitivity")
        measured = [base, *(f for f in mixed.DEFAULT_UPGRADES
                            if mixed.format_bits(f, 4096) > mixed.format_bits(base, 4096))]
        sensitivity = mixed.layer_sensitivity(model, arch, windows[: settings.sensitivity_windows], measured,
                                              settings.sym)
        upgrades = measured[1:]
        if settings.bits < 8:
            upgrades.append((8, settings.group_size))
            sensitivity |= mixed.estimate_wider(sensitivity, base, (8, settings.group_size))
        plan.update(mixed.allocate(free, sensitivity, base, [*upgrades, mixed.DENSE], target_free))
    bits = mixed.plan_bits(units, plan)
    if settings.target_bits is not None and bits > settings.target_bits + 1e-6:
        raise ValueError(f"target_bits {settings.target_bits}: the layers dynamic sets already take {bits:.3f} "
                         "bits per weight")
    if settings.target_bits is not None or settings.dynamic:
        logger.info("mixed precision: %.3f stored bits per weight over the linear layers (%d of %d in the base "
                    "format)", bits, sum(plan[u.name] == base for u in units), len(units))
    # the user's patterns as given (they decide their layers), then one per layer the allocation moved
    return plan, {**(settings.dynamic or {}), **mixed.dynamic_config(free, plan, base)}, bits


@torch.inference_mode()
def _embed(model: torch.nn.Module, windows: list[list[int]]) -> list[tuple[list[int], torch.Tensor, Any]]:
    """(tokens, hidden [T, hidden], residual None) per window: the inputs of layer 0."""
    return [(w, model.model.embed_tokens(torch.tensor(w)), None) for w in windows]


@torch.inference_mode()
def _run_layer(model: torch.nn.Module, arch: Any, layer: torch.nn.Module,
               states: list[tuple[list[int], torch.Tensor, Any]]) -> list[tuple[list[int], torch.Tensor, Any]]:
    """Each window's (hidden, residual) through one decoder layer, over a fresh one-layer paged cache."""
    from loom.attention import build_attention_metadata
    from loom.worker.kv_cache import allocate_kv_caches

    block_size = 16
    new = []
    for tokens, hidden, residual in states:
        num_blocks = -(-len(tokens) // block_size)
        cache = allocate_kv_caches(arch, num_blocks, block_size, torch.float32, torch.device("cpu"))[0]
        meta = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(num_blocks))], block_size,
                                        torch.device("cpu"))
        positions = torch.arange(len(tokens))
        hidden, residual = layer(hidden, residual, model.model.rotary_emb.cos_sin(positions), cache, meta)
        new.append((tokens, hidden, residual))
    return new


def _layer_hessian(model: torch.nn.Module, arch: Any, layer: torch.nn.Module, lin: torch.nn.Module,
                   states: list[tuple[list[int], torch.Tensor, Any]]) -> torch.Tensor:
    """H = 2 X X^T / n of `lin`'s inputs X over every window run through `layer` as it is now."""
    acc: dict[str, Any] = {"h": None, "n": 0}

    def hook(_m: torch.nn.Module, args: tuple) -> None:
        acc["h"], acc["n"] = accumulate_hessian(acc["h"], acc["n"], args[0])

    handle = lin.register_forward_pre_hook(hook)
    try:
        _run_layer(model, arch, layer, states)
    finally:
        handle.remove()
    return acc["h"]


def split_rows(weight: GPTQWeight, sizes: list[int]) -> list[GPTQWeight]:
    """A stacked layer's GPTQWeight cut into its projections' (rows of codes, columns of scales / zeros)."""
    parts, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        parts.append(GPTQWeight(weight.codes[rows].contiguous(), weight.scales[:, rows].contiguous(),
                                weight.zeros[:, rows].contiguous(), weight.g_idx.clone(), weight.bits))
        start += size
    return parts


def checkpoint_tensors(source: dict[str, torch.Tensor], quantized: dict[str, GPTQWeight], model: torch.nn.Module,
                       half: frozenset[str] = frozenset(), checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The output's tensors: each quantized projection's GPTQ tensors (in `checkpoint_format`) in place of its
    weight; the rest of the source (embeddings, norms, LM head, biases) in float32, but the tensors named in `half`
    (the weights of linear layers mixed precision keeps in 16 bits) in float16."""
    from loom.quant.gptq_format import to_checkpoint

    tensors = {}
    replaced = set()
    for name, weight in quantized.items():
        lin = model.get_submodule(name)
        head, _, last = name.rpartition(".")
        for proj, part in zip(PROJECTIONS[last], split_rows(weight, lin.output_sizes), strict=True):
            for key, t in to_checkpoint(part, checkpoint_format).items():
                tensors[f"{head}.{proj}.{key}"] = t
            replaced.add(f"{head}.{proj}.weight")
    missing = replaced - set(source)
    if missing:
        raise ValueError(f"the source checkpoint lacks {sorted(missing)[:4]}")
    for name, t in source.items():
        if name not in replaced:
            tensors[name] = (t.half() if name in half else t.float()).contiguous()
    return tensors


def check_lm_head_bits(lm_head_bits: int | None, vocab_size: int) -> None:
    """Raises ValueError when the head's output channels do not pack into GPTQ's int32 qzeros at lm_head_bits."""
    if lm_head_bits is not None and vocab_size % (32 // lm_head_bits):
        raise ValueError(f"lm_head_bits: a vocabulary of {vocab_size} tokens does not pack {32 // lm_head_bits} to an "
                         "int32 (GPTQ's qzeros pack the output channels); keep the head dense")


def lm_head_tensors(source: dict[str, torch.Tensor], settings: GPTQSettings, checkpoint_format: str = "gptq",
                    ) -> dict[str, torch.Tensor]:
    """The LM head (its own weight, or the tied embedding's) by RTN at settings.lm_head_bits, as GPTQ tensors under
    "lm_head." (group size and grid as the settings'; g_idx the plain group order).

    Raises:
        ValueError: the source has neither lm_head.weight nor model.embed_tokens.weight.
    """
    from loom.quant.gptq_format import to_checkpoint

    weight = source.get("lm_head.weight", source.get("model.embed_tokens.weight"))
    if weight is None:
        raise ValueError("the source checkpoint has no lm_head.weight or model.embed_tokens.weight to quantize")
    q = rtn_quantize(weight.float(), settings.lm_head_bits, settings.group_size, settings.sym)
    return {f"lm_head.{key}": t for key, t in to_checkpoint(q, checkpoint_format).items()}


@dataclass(slots=True)
class GPTQResult:
    output: Path
    settings: GPTQSettings
    calibration: str  # where the calibration tokens came from ("" for rtn)
    calibration_tokens: int
    seconds: float  # wall time of the whole run (loading, calibration, quantization, writing)
    quantization_config: dict[str, Any] | None = None  # what config.json says
    bits_per_weight: float = 0.0  # stored bits per weight of the decoder's linear layers


def write_gptq_checkpoint(model: str | None, output: str, settings: GPTQSettings, windows: list[list[int]], *,
                          calibration: str = "") -> GPTQResult:
    """Quantize `model` (GGUF file, HF directory, None = the bundled model) with `settings` and write a GPTQ
    checkpoint to `output` (model.safetensors, config.json with quantization_config, the tokenizer).

    Raises:
        ValueError: bad settings, an architecture loom cannot write a config for, an output directory that
            exists and is not empty, no calibration window for gptq, or a group size beyond a layer's input.
    """

    from loom.model.loader import load_model
    from loom.model.loader.model_loader import resolve_model_path
    from loom.quant.mixed import units_of
    from loom.quant.quantize import MODEL_TYPES, _check_output, calibrates, source_checkpoint, write_checkpoint

    settings.check()
    out = _check_output(output)
    start = time.perf_counter()
    path = resolve_model_path(model)
    loaded = load_model(model, torch.float32, torch.device("cpu"), quantization="none")
    if loaded.arch.architecture not in MODEL_TYPES:
        raise ValueError(f"{settings.method} cannot write a config for {loaded.arch.architecture}")
    check_lm_head_bits(settings.lm_head_bits, loaded.arch.vocab_size)
    tokens = sum(len(w) for w in windows) if calibrates(settings.method, settings.target_bits, "") else 0
    plan, dynamic, bits = mixed_precision_plan(loaded.model, loaded.arch, settings, windows)
    quantized = quantize_model_weights(loaded.model, loaded.arch, settings, windows, plan)
    half = frozenset(f"{p}.weight" for u in units_of(loaded.model) if plan[u.name] is None for p in u.projections)
    source, config = source_checkpoint(path, loaded.arch, set(loaded.eos_token_ids))
    config["quantization_config"] = settings.quantization_config(calibration if tokens else "", tokens, dynamic)
    tensors = checkpoint_tensors(source, quantized, loaded.model, half)
    if settings.lm_head_bits is not None:
        tensors.update(lm_head_tensors(source, settings))
        tensors.pop("lm_head.weight", None)
        config["tie_word_embeddings"] = False  # the embedding stays float, the head reads its own packed copy
    write_checkpoint(out, tensors, config, loaded.tokenizer)
    seconds = time.perf_counter() - start
    logger.info("wrote %s in %.1f s", out, seconds)
    return GPTQResult(out, settings, calibration if tokens else "", tokens, seconds, config["quantization_config"],
                      bits)
