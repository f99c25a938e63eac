"""`loom quantize` command line (torch is imported only when the command runs)."""

from __future__ import annotations

import argparse

from loom.engine.arg_utils import at_least


def _alpha(value: str) -> float | str:
    if value == "search":
        return value
    try:
        alpha = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'search', got {value!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return alpha




def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM as an exit that unwinds (status 128 + signum), so a killed run removes what it wrote, as Ctrl-C does."""
    raise SystemExit(128 + signum)


def cmd_quantize(ns: argparse.Namespace) -> int:
    import signal

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _quantize(ns)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _quantize(ns: argparse.Namespace) -> int:
    # a wrong path, output or option is refused before torch loads (quantize() checks them all again)
    from loom.config import check_model_path
    from loom.quant import METHOD_OPTIONS, check_method_options, check_output_path

    if ns.model is not None:
        check_model_path(ns.model)
    check_method_options(ns.method, {name: getattr(ns, name) for name in METHOD_OPTIONS})
    check_output_path(ns.output)
    from loom.quant.quantize import quantize

    result = quantize(ns.model, ns.output, ns.method, alpha=ns.alpha, calibration_file=ns.calibration_file,
                      num_windows=ns.calibration_windows, window_len=ns.calibration_window_len, bits=ns.bits,
                      group_size=ns.group_size, sym=ns.sym, desc_act=ns.desc_act,
                      static_groups=ns.static_groups, damp_percent=ns.damp_percent,
                      awq_clip=ns.awq_clip, awq_scaling=ns.awq_scaling, awq_loss=ns.awq_loss,
                      target_bits=ns.target_bits, dynamic=ns.dynamic,
                      sensitivity_windows=ns.sensitivity_windows, prune_score=ns.prune_score,
                      activation_scales=ns.activation_scales, lm_head_bits=ns.lm_head_bits,
                      weight_rounding=ns.weight_rounding)
    if result.method == "sparse24":
        calibrated = (f", {result.calibration_tokens} calibration tokens of {result.calibration}"
                      if result.calibration_tokens else "")
        score = ns.prune_score or "wanda"
        print(f"wrote {result.output} (2:4 sparsity by {score}{calibrated}; dense float32 weights with two "
              f"zeros in every four) in {result.seconds:.1f} s: loom generate --model {result.output} ...")
        return 0
    if result.method == "fp8":
        print(f"wrote {result.output} (fp8 e4m3, a float32 scale per output channel; {result.bits_per_weight:.3f} "
              f"stored bits per linear weight) in {result.seconds:.1f} s; a compressed-tensors checkpoint, run by "
              f"loom's fp8 method: loom generate --model {result.output} ...")
        return 0
    if result.method == "w8a8":
        acts = result.quantization_config["config_groups"]["group_0"]["input_activations"]
        rounding = " by GPTQ" if ns.weight_rounding == "gptq" else ""
        print(f"wrote {result.output} (SmoothQuant alpha {result.alpha}, int8 weights per channel{rounding}, "
              f"{'dynamic per-token' if acts['dynamic'] else 'static per-tensor'} int8 activations; "
              f"{result.calibration_tokens} calibration tokens of {result.calibration}) in {result.seconds:.1f} s; "
              f"a compressed-tensors W8A8 checkpoint: loom generate --model {result.output} ...")
        if not acts["dynamic"]:
            print("note: one static scale per layer input leaves a model with outlier channels few levels (the "
                  "bundled model: +25% perplexity at alpha 0.5, +7.9% at 0.8, +1.2% dynamic; docs/quantization.md); "
                  "measure it with loom bench quality --model OUT --reference-model SOURCE --quantization w8a8")
        return 0
    if result.method == "awq" and result.quantization_config.get("quant_method") == "gptq":  # awq + target_bits
        qc = result.quantization_config
        meta = qc.get("meta", {})
        rounded = (", every layer rounded by GPTQ" if meta.get("weight_rounding") == "gptq"
                   else f", {'+'.join(meta.get('clipped') or ()) or 'none'} clipped")
        print(f"wrote {result.output} (awq scales, duo won {meta.get('duo_groups')} of {meta.get('scaled_groups')} "
              f"groups, then mixed precision: {result.bits_per_weight:.3f} stored bits per "
              f"linear weight at target {meta.get('target_bits')}, {meta.get('base_format_groups')} of "
              f"{meta.get('layer_groups')} layer groups in the 4-bit group size {qc['group_size']} base"
              f"{rounded}"
              f"{f', LM head {ns.lm_head_bits}-bit' if qc.get('lm_head') else ''}, {result.calibration_tokens} "
              f"calibration tokens of {result.calibration}) in {result.seconds:.1f} s; a GPTQ-format checkpoint "
              f"({qc['checkpoint_format']}), run by loom's packed kernels: loom generate --model {result.output} ...")
        return 0
    if result.method == "awq":
        qc = result.quantization_config
        meta = qc.get("meta", {})
        chosen_on = (f" (chosen on {meta.get('clip_windows')} "
                     f"{'held-out' if meta.get('clip_held_out') else 'searched, not held-out,'} calibration windows)"
                     if meta.get("clip") == "auto" else "")
        print(f"wrote {result.output} (awq, 4 bits, group size {qc['group_size']}, scaling {meta.get('scaling')}, "
              f"loss {meta.get('loss')}: "
              f"duo won {meta.get('duo_groups')} of {meta.get('scaled_groups')} groups, "
              + ("weights rounded by GPTQ, unclipped, " if meta.get("weight_rounding") == "gptq" else
                 f"clip {meta.get('clip')}: {'+'.join(meta.get('clipped') or ()) or 'none'} clipped{chosen_on}, ")
              + f"{result.calibration_tokens} "
              f"calibration tokens of {result.calibration}) in {result.seconds:.1f} s; an AutoAWQ gemm checkpoint, "
              f"run by loom's packed kernels: loom generate --model {result.output} ...")
        return 0
    if result.quantization_config is not None:
        qc = result.quantization_config
        calibrated = (f", {result.calibration_tokens} calibration tokens of {result.calibration}"
                      if result.calibration_tokens else "")
        from loom.quant.gptq_checkpoint import LM_HEAD_RULE

        layer_rules = [k for k in qc.get("dynamic", {}) if k != LM_HEAD_RULE]
        mixed = f", per-layer overrides: {len(layer_rules)} patterns" if layer_rules else ""
        if qc.get("lm_head"):
            mixed += f", LM head {ns.lm_head_bits}-bit"
        order = (", desc_act" + (", static groups" if qc.get("static_groups") else "")) if qc["desc_act"] else ""
        print(f"wrote {result.output} ({result.method}, {qc['bits']} bits, group size {qc['group_size']}, "
              f"{'sym' if qc['sym'] else 'asym'}{order}{mixed}; "
              f"{result.bits_per_weight:.3f} stored bits per linear weight{calibrated}) in "
              f"{result.seconds:.1f} s; a GPTQ-format checkpoint, run by loom's packed kernels: "
              f"loom generate --model {result.output} ...")
        return 0
    rounding = ", weights GPTQ'd onto w8a8's grid" if ns.weight_rounding == "gptq" else ""
    print(f"wrote {result.output} ({result.method}, alpha {result.alpha}{rounding}, {result.calibration_tokens} "
          f"calibration tokens of {result.calibration}) in {result.seconds:.1f} s; it runs as w8a8 by default: "
          f"loom generate --model {result.output} ...")
    return 0


def _target_bits(value: str) -> float:
    try:
        bits = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits per weight, got {value!r}") from None
    if not 2.0 <= bits <= 16.0:
        raise argparse.ArgumentTypeError(f"must be in [2, 16], got {value}")
    return bits


def _dynamic(value: str) -> dict:
    """A JSON object, inline or in a file (a value that does not start with "{" or "[" is a path)."""
    import json
    from pathlib import Path

    try:
        text = value if value.lstrip()[:1] in ("{", "[") else Path(value).read_text(encoding="utf-8")
        parsed = json.loads(text)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of pattern -> overrides")
    return parsed


def _group_size(value: str) -> int:
    from loom.quant.gptq_checkpoint import GROUP_SIZES

    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if size not in GROUP_SIZES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(str, GROUP_SIZES))}, got {size}")
    return size


def _fraction(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0.0 < x < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return x


def register_quantize(sub: argparse._SubParsersAction) -> None:
    """Add `loom quantize` to loom's subcommands."""
    from loom.quant import QUANTIZE_METHODS

    p = sub.add_parser("quantize", help="write a quantized checkpoint (RTN, GPTQ, AWQ, FP8) or one prepared for "
                       "W8A8 (SmoothQuant)",
                       description="Write a quantized checkpoint. rtn / gptq: a Hugging Face GPTQ-format checkpoint "
                       "(4 or 8 bits; GPTQ, Frantar et al. 2022, calibrated on ShareGPT conversations and prose, or "
                       "a text file), run by loom's packed kernels. awq: an AutoAWQ gemm checkpoint (4 bits, asymmetric; "
                       "AWQ, Lin et al. 2023). smoothquant: fold SmoothQuant's per-channel scales "
                       "(Xiao et al. 2022) into the weights; the output runs as w8a8 by default. w8a8: SmoothQuant "
                       "then int8 per channel, a compressed-tensors W8A8 checkpoint (vLLM's format), int8 activations "
                       "per token or with calibrated static scales. fp8: e4m3 weights "
                       "with a scale per output channel (compressed-tensors layout). sparse24: 2:4 pruning by "
                       "magnitude or Wanda, a quality study (dense weights with zeros).")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--output", required=True, help="directory to write (must not exist, or be empty)")
    p.add_argument("--method", choices=QUANTIZE_METHODS, default="smoothquant", help="(default: %(default)s)")
    p.add_argument("--alpha", type=_alpha, default=None,
                   help="smoothquant / w8a8: SmoothQuant migration strength in [0, 1], or 'search' for the best per "
                   "layer on the calibration tokens (default: 0.5)")
    p.add_argument("--calibration-file", default=None,
                   help="UTF-8 text to calibrate on (default: ShareGPT conversations and Jane Austen's Emma, window by "
                   "window; needs loom[bench])")
    p.add_argument("--calibration-windows", type=at_least(1), default=None,
                   help="calibration windows, one prefill each (default: 8)")
    p.add_argument("--calibration-window-len", type=at_least(2), default=None,
                   help="tokens per calibration window (default: 512)")
    p.add_argument("--activation-scales", choices=("dynamic", "static"), default=None,
                   help="w8a8: int8 activations with a scale per token at run time, or one per layer input "
                   "calibrated here (default: dynamic)")
    p.add_argument("--weight-rounding", choices=("rtn", "gptq"), default=None,
                   help="smoothquant / w8a8: the smoothed weights onto the int8 per-channel grid by round to nearest "
                   "(smoothquant: at load) or by GPTQ on the calibration tokens (smoothquant: in the rotated basis "
                   "run-time w8a8 multiplies in). awq: rtn is AWQ's own clipping and round to nearest; gptq keeps "
                   "AWQ's scales and rounds the scaled weights by GPTQ instead, unclipped (llm-compressor's AWQ + "
                   "GPTQ; --awq-clip is then refused, --damp-percent applies; with --target-bits every layer in its "
                   "format) (default: rtn)")
    g = p.add_argument_group("rtn / gptq / awq / sparse24")
    g.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="rtn / gptq: 4 or 8; awq: 4 (default: 4)")
    g.add_argument("--group-size", type=_group_size, default=None,
                   help="rtn / gptq / awq: input columns per scale: 32, 64, 128, or (rtn / gptq) -1 for one per "
                   "output channel (default: 128)")
    g.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="rtn / gptq: symmetric grid; --no-sym or --asym: with a zero point (default: symmetric)")
    g.add_argument("--asym", dest="sym", action="store_false", default=None, help=argparse.SUPPRESS)
    g.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: act-order, quantize columns by decreasing Hessian diagonal (default: on); awq with "
                   "--weight-rounding gptq: the same, over static groups (default: on)")
    g.add_argument("--static-groups", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq with act-order: fix each group's scale and zero first, over consecutive columns, so the "
                   "file keeps plain group order and runs in loom's C decode step (default: on with act-order; "
                   "--no-static-groups: groups in act order, g_idx permuted, run per layer)")
    g.add_argument("--awq-clip", choices=("auto", "on", "off"), default=None,
                   help="awq: per-group weight clipping after the scales: on (the reference implementation's), off, "
                   "or auto: per projection type, the clipping that brings the model closest to the unquantized one "
                   "(KL) without raising its perplexity, scored on calibration windows the scale search did not read "
                   "(up to 7 more forward passes over them) (default: auto; off with --weight-rounding gptq, which "
                   "refuses on and auto)")
    g.add_argument("--awq-loss", choices=("mse", "normalized"), default=None,
                   help="awq: the scale search's block error: mse (the paper's) or normalized (each output channel's "
                   "error relative to its own RMS, so a model's few huge residual channels do not decide it) "
                   "(default: normalized)")
    g.add_argument("--awq-scaling", choices=("activation", "duo", "both"), default=None,
                   help="awq: the scale formulas searched: the paper's mean|x|^alpha (activation), AutoAWQ's later "
                   "default mean|x|^alpha / w_mean^(1-alpha) (duo), or both grids, keeping the better (both; "
                   "twice the scale search's time) (default: both)")
    g.add_argument("--damp-percent", type=_fraction, default=None,
                   help="gptq (and awq with --weight-rounding gptq): dampening, a fraction of the Hessian's mean "
                   "diagonal (default: 0.01)")
    g.add_argument("--lm-head-bits", type=int, choices=(4, 8), default=None,
                   help="rtn, gptq (awq with --target-bits): quantize the LM head too (a tied embedding's matrix; the embedding stays float) "
                   "by RTN at 4 or 8 bits, GPTQModel's lm_head: true; 8 costs ~no quality and cuts a small model's "
                   "bytes per token by half (default: the head kept dense, as AutoGPTQ writes it)")
    g.add_argument("--prune-score", choices=("wanda", "magnitude"), default=None,
                   help="sparse24: importance of each weight, |W| * ||X|| (Wanda, Sun et al. 2023) or |W| "
                   "(default: wanda)")
    m = p.add_argument_group("mixed precision (rtn / gptq / awq: awq then writes a GPTQ-format file)")
    m.add_argument("--target-bits", type=_target_bits, default=None,
                   help="stored bits per weight of the decoder's linear layers (e.g. 4.5): the layers whose "
                   "quantization raises the output KL most on the calibration tokens move to 4-bit groups of 32, "
                   "8 bits or 16 bits until the budget is spent (ZeroQ's sensitivity, Cai et al. 2020)")
    m.add_argument("--dynamic", type=_dynamic, default=None,
                   help="per-module overrides as GPTQModel's quantization_config.dynamic, inline JSON or a file: "
                   "'{\"+:.*\\.down_proj\": {\"bits\": 8}, \"-:model\\.layers\\.0\\..*\": {}}' ('-:' keeps a "
                   "module in 16 bits); they win over --target-bits")
    m.add_argument("--sensitivity-windows", type=at_least(1), default=None,
                   help="with --target-bits: calibration windows the sensitivity is measured on (default: 1)")
    p.set_defaults(func=cmd_quantize)
