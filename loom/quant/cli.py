"""`loom quantize` command line (torch is imported only when the command runs)."""

from __future__ import annotations

import argparse


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


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def cmd_quantize(ns: argparse.Namespace) -> int:
    from loom.quant.quantize import quantize

    result = quantize(ns.model, ns.output, ns.method, alpha=ns.alpha, calibration_file=ns.calibration_file,
                      num_windows=ns.calibration_windows, window_len=ns.calibration_window_len)
    print(f"wrote {result.output} ({result.method}, alpha {result.alpha}, {result.calibration_tokens} calibration "
          f"tokens of {result.calibration}) in {result.seconds:.1f} s; it runs as w8a8 by default: "
          f"loom generate --model {result.output} ...")
    return 0


def register_quantize(sub: argparse._SubParsersAction) -> None:
    """Add `loom quantize` to loom's subcommands."""
    from loom.quant.quantize import QUANTIZE_METHODS

    p = sub.add_parser("quantize", help="write a checkpoint prepared for a quantization method (SmoothQuant)",
                       description="Write a checkpoint prepared for a quantization method. smoothquant: fold "
                       "SmoothQuant's per-channel scales (Xiao et al. 2022) into the weights, calibrated on "
                       "ShareGPT conversations or a text file; the output runs as w8a8 by default.")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--output", required=True, help="directory to write (must not exist, or be empty)")
    p.add_argument("--method", choices=QUANTIZE_METHODS, default="smoothquant", help="(default: %(default)s)")
    p.add_argument("--alpha", type=_alpha, default=0.5,
                   help="SmoothQuant migration strength in [0, 1], or 'search' for the best per layer on the "
                   "calibration tokens (default: %(default)s)")
    p.add_argument("--calibration-file", default=None,
                   help="UTF-8 text to calibrate on (default: ShareGPT conversations; needs loom[bench])")
    p.add_argument("--calibration-windows", type=_positive, default=8,
                   help="calibration windows, one prefill each (default: %(default)s)")
    p.add_argument("--calibration-window-len", type=_positive, default=512,
                   help="tokens per calibration window (default: %(default)s)")
    p.set_defaults(func=cmd_quantize)
