"""`loom bench quant` command line (torch is imported only when the command runs); the report is
loom/bench/quant_report.py."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path

from loom.engine.arg_utils import at_least

logger = logging.getLogger(__name__)


def cmd_quant(ns: argparse.Namespace) -> int:
    from loom.bench import quant_report as qr
    from loom.bench.heldout import check_not_calibrated_on, janeausten_text
    from loom.bench.quality import token_windows
    from loom.model.loader import load_tokenizer
    from loom.model.loader.model_loader import read_arch, resolve_model_path

    checkpoints = [qr.parse_checkpoint_arg(c) for c in ns.checkpoint]
    if ns.result_dir.exists() and not ns.result_dir.is_dir():
        raise ValueError(f"--result-dir {str(ns.result_dir)!r} is a file, not a directory")
    entries = [qr.QuantEntry(m, "loom", ns.model, m) for m in ns.methods]
    for kv in ns.kv_cache_dtypes:
        entries += [qr.QuantEntry(f"{m} + KV {kv}", "loom", ns.model, m, kv) for m in ns.kv_with]
    entries += checkpoints
    if not entries:
        raise ValueError("nothing to measure: give --methods, --kv-cache-dtypes (with --kv-with) or --checkpoint")
    try:  # made now, so that a directory that cannot be written fails before the measuring, not after it
        ns.result_dir.mkdir(parents=True, exist_ok=True)
        probe = ns.result_dir / ".loom-write-check"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--result-dir {str(ns.result_dir)!r} cannot be written: {exc.strerror or exc}") from None
    if ns.text_file is None:
        check_not_calibrated_on([e.model for e in checkpoints], ns.book)
    taken = [e.label for e in entries]
    if len(set(taken)) != len(taken):
        raise ValueError(f"--checkpoint labels must differ from each other and from the method rows, got {taken}")
    tools = None
    if ns.llama_cpp is not None:
        converter = ns.llama_cpp_converter or ns.llama_cpp.parent / "src" / "convert_hf_to_gguf.py"
        tools = qr.LlamaCpp(ns.llama_cpp, converter, ns.threads)
        for exe in ("llama-quantize", "llama-perplexity", "llama-bench"):
            try:
                tools.exe(exe)  # names the missing tool before any slow work
            except FileNotFoundError as exc:
                raise ValueError(f"--llama-cpp: {exc}") from None
        if not converter.is_file():
            raise ValueError(f"--llama-cpp-converter: {converter} is missing")
    if ns.threads is not None:
        import torch

        torch.set_num_threads(ns.threads)
    tokenizer = load_tokenizer(ns.model)
    try:
        text = janeausten_text(ns.book) if ns.text_file is None else Path(ns.text_file).read_text(encoding="utf-8")
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"--book/--text-file: {exc}") from exc
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    arch = read_arch(ns.model)
    windows = token_windows(ids, ns.num_windows, ns.window_len, arch.max_position_embeddings)
    vocab = arch.vocab_size

    llama_files: dict[str, Path] = {}
    work = ns.result_dir / "llama-cpp"
    if tools is not None:
        llama_files = qr.llama_cpp_files(tools, ns.model, work, ns.llama_cpp_types)
        entries += [qr.QuantEntry(f"llama.cpp {t}", "llama.cpp", str(p)) for t, p in llama_files.items()]
    round_trip: dict[str, float] = {}  # llama.cpp row label -> share of its linear weight bytes that are the source's
    source_path = resolve_model_path(ns.model)
    if llama_files and source_path.is_file():  # a GGUF source (a directory is a Hugging Face one)
        for qtype, path in llama_files.items():
            share = qr.source_identical_share(source_path, path)
            round_trip[f"llama.cpp {qtype}"] = share
            if share > qr.ROUND_TRIP_SHARE:
                logger.warning("llama.cpp %s: %.1f%% of its linear weight bytes are the source's own (the source "
                               "is already in this type's choices); its row measures a round trip", qtype,
                               100 * share)

    quality = qr.measure_quality(ns.model, entries, windows)
    llama_quality: dict[str, dict[str, float]] = {}
    if tools is not None:
        held = work / "heldout.txt"
        held.write_text(tokenizer.decode(ids[: (ns.num_windows + 1) * ns.window_len]), encoding="utf-8")
        llama_quality = qr.llama_perplexity(tools, llama_files, held, ns.num_windows, ns.window_len, work)
    rows = []
    for entry, q in zip(entries, quality, strict=True):
        speed: dict = {}
        if ns.speed:
            if entry.engine == "loom":
                speed = qr.loom_speed_in_subprocess(entry, vocab)
            else:
                speed = qr.llama_speed(tools, Path(entry.model))
        lq = llama_quality.get(entry.label.removeprefix("llama.cpp "))
        identical = round_trip.get(entry.label)
        rows.append(qr.QuantRow(
            entry.label, entry.engine, q["quantization"], entry.kv_cache_dtype, q["perplexity"],
            q["perplexity_change_pct"], q["top1_agreement"], q["mean_kl"], q["weight_mb"], q["linear_bits"],
            speed.get("decode_tok_s"), speed.get("batch32_output_tok_s"), speed.get("prefill_tok_s"),
            None if lq is None else lq["perplexity"], None if lq is None else lq["mean_kl"],
            None if lq is None else lq["top1_pct"], identical))
        print(qr.markdown_row(rows[-1]), flush=True)
    reference_ppl = quality[0]["perplexity_ref"]
    table = qr.markdown_table(rows, reference_ppl)
    held_out = (f"held-out: {ns.text_file or ns.book}, {len(windows)} window{'s' if len(windows) != 1 else ''} x "
                f"{ns.window_len} tokens; source: {ns.model or 'the bundled model'}")
    (ns.result_dir / "quant.md").write_text(held_out + "\n\n" + table)
    (ns.result_dir / "quant.json").write_text(json.dumps({
        "model": ns.model, "held_out": ns.text_file or ns.book, "num_windows": ns.num_windows,
        "window_len": ns.window_len, "reference_perplexity": reference_ppl,
        "rows": [asdict(r) for r in rows]}, indent=2))
    png = qr.plot_rows(rows, ns.result_dir / "quant.png", f"{Path(ns.model).name if ns.model else 'bundled model'}"
                       f": KL vs weight bytes, {ns.num_windows} x {ns.window_len} tokens")
    print(held_out)
    print(table)
    print(f"wrote {ns.result_dir / 'quant.md'}, quant.json and {png}")
    return 0


def register_quant(bench_sub: argparse._SubParsersAction) -> None:
    """Add `loom bench quant` to the `loom bench` subcommands."""
    from loom.config import QUANTIZATION_METHODS, SUPPORTED_KV_CACHE_DTYPES

    from loom.bench.quant_report import LLAMA_CPP_TYPES

    p = bench_sub.add_parser("quant", help="quality, bytes and speed of each quantization format, llama.cpp beside",
                             description="One table and one plot: perplexity, KL and top-1 agreement against the "
                             "unquantized model on held-out prose, weight bytes, and decode / batch-32 / prefill "
                             "speed, for loom's methods, `loom quantize` checkpoints, quantized KV caches and "
                             "llama.cpp's formats of the same source.")
    p.add_argument("--model", default=None,
                   help="the source: GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--methods", nargs="*", default=["none", "gguf", "w8a16", "w4a16", "w8a8"],
                   choices=QUANTIZATION_METHODS, help="loom run-time methods on the source (default: %(default)s)")
    p.add_argument("--kv-cache-dtypes", nargs="*", default=["int8", "fp8_e4m3"],
                   choices=[d for d in SUPPORTED_KV_CACHE_DTYPES if d != "auto"],
                   help="quantized KV caches, each with every --kv-with method (default: %(default)s; the "
                   "option with no value: no KV rows)")
    p.add_argument("--kv-with", nargs="*", default=["none", "gguf"], choices=QUANTIZATION_METHODS,
                   help="weight methods the KV rows run with (default: %(default)s)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR",
                   help="a `loom quantize` output (or any GPTQ / AWQ checkpoint of the source), repeatable")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                   help="llama.cpp's tools (benchmarks/install_peers.sh): convert, quantize and measure its formats")
    p.add_argument("--llama-cpp-converter", type=Path, default=None,
                   help="convert_hf_to_gguf.py (default: BIN_DIR/../src/convert_hf_to_gguf.py)")
    p.add_argument("--llama-cpp-types", nargs="*", default=list(LLAMA_CPP_TYPES),
                   help="llama-quantize types (default: %(default)s)")
    p.add_argument("--book", default="prideprejudice", help="Jane Austen novel (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="held-out text file instead of a novel")
    p.add_argument("--num-windows", type=at_least(1), default=16, help="windows (default: %(default)s)")
    p.add_argument("--window-len", type=at_least(2), default=512, help="tokens per window (default: %(default)s)")
    p.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                   help="measure decode, batch-32 and prefill speed (default: on)")
    p.add_argument("--threads", type=at_least(1), default=2,
                   help="threads for loom and llama.cpp (default: %(default)s)")
    p.add_argument("--result-dir", type=Path, default=Path("benchmarks/results/quant"),
                   help="where quant.md, quant.json and quant.png go (default: %(default)s)")
    p.set_defaults(func=cmd_quant)
