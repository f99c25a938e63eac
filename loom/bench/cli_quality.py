"""`loom bench quality` command line (torch is imported only when the command runs)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def cmd_quality(ns: argparse.Namespace) -> int:
    from loom.bench.heldout import check_not_calibrated_on, janeausten_text
    from loom.bench.quality import run_quality, token_windows
    from loom.model.loader import load_tokenizer
    from loom.model.loader.model_loader import read_arch

    if ns.text_file is None:
        check_not_calibrated_on([ns.model], ns.book)
    tokenizer = load_tokenizer(ns.model)
    try:
        text = janeausten_text(ns.book) if ns.text_file is None else Path(ns.text_file).read_text(encoding="utf-8")
    except (RuntimeError, OSError) as exc:  # the held-out text cannot be had: a one-line error, no traceback
        raise ValueError(f"--book/--text-file: {exc}") from exc
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    windows = token_windows(ids[ns.skip_tokens:], ns.num_windows, ns.window_len,
                            read_arch(ns.model).max_position_embeddings)
    results = run_quality(ns.model, ns.quantization, ns.dtype, windows, ns.reference_model)
    reference = "" if ns.reference_model is None else f" of {ns.reference_model}"
    print(f"held-out: {ns.text_file or ns.book}, {len(windows)} windows x {ns.window_len} tokens; reference: "
          f"quantization none, float32{reference}")
    print("| quantization | dtype | decode weight MB | perplexity | change | top-1 agreement | mean KL (nats) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.quantization} | {r.dtype} | {r.weight_mb:.1f} | {r.perplexity:.3f} | {r.perplexity_change_pct:+.2f}% "
              f"| {100 * r.top1_agreement:.2f}% | {r.mean_kl:.5f} |")
    if ns.result_dir is not None:
        ns.result_dir.mkdir(parents=True, exist_ok=True)
        out = ns.result_dir / "quality.json"
        out.write_text(json.dumps([asdict(r) for r in results], indent=2))
        print(f"wrote {out}")
    return 0


def register_quality(bench_sub: argparse._SubParsersAction) -> None:
    """Add `loom bench quality` to the `loom bench` subcommands."""
    from loom.engine.arg_utils import at_least
    from loom.config import QUANTIZATION_METHODS

    p = bench_sub.add_parser("quality", help="perplexity, top-1 agreement and KL of quantized paths vs float32")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--quantization", nargs="+", default=["gguf", "w8a16", "w4a16", "w8a8", "fp8"],
                   choices=QUANTIZATION_METHODS, help="methods to compare (default: %(default)s)")
    p.add_argument("--reference-model", default=None,
                   help="checkpoint whose float32 logits are the reference (default: --model; e.g. the source of "
                   "a `loom quantize` output)")
    p.add_argument("--dtype", default="auto", help="activation dtype of the methods compared (default: %(default)s)")
    p.add_argument("--book", default="prideprejudice", help="Jane Austen novel (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="held-out text file instead of a novel")
    p.add_argument("--num-windows", type=at_least(1), default=8, help="windows (default: %(default)s)")
    p.add_argument("--window-len", type=at_least(2), default=512, help="tokens per window (default: %(default)s)")
    p.add_argument("--skip-tokens", type=at_least(0), default=0,
                   help="tokens skipped at the start (default: %(default)s)")
    p.add_argument("--result-dir", type=Path, default=Path("benchmarks/results"), help="where quality.json goes")
    p.set_defaults(func=cmd_quality)
