"""`loom bench quant`: quality, size and speed of every quantization format of one model in one table, with
llama.cpp's formats of the same source beside them.

Rows:
- loom run-time methods on the source (`--methods`: gguf, w8a16, w4a16, w8a8, fp8, ...), optionally with a
  quantized KV cache (`--kv-cache-dtypes int8 fp8_e4m3`: each also alone, on the float32 model);
- checkpoints written by `loom quantize` (`--checkpoint LABEL=DIR`: GPTQ, AWQ, mixed precision, SmoothQuant),
  run by their default method;
- llama.cpp (`--llama-cpp BIN_DIR`): the source converted to an F16 GGUF by llama.cpp's own converter, then
  `llama-quantize`d to each `--llama-cpp-types` (Q8_0, Q4_0, Q4_K_M, Q6_K).

Columns, all against the unquantized source (for a GGUF source, its weights dequantized: the only full-precision
copy there is) on the same held-out prose (Jane Austen, >= 16 x 512 tokens, disjoint from any calibration text):
- perplexity, its change, top-1 agreement and mean KL(reference || row), loom's protocol
  (loom/bench/quality.py: teacher-forced windows, every position scored). llama.cpp's files are scored the same
  way, their weights dequantized to float32 by loom's GGUF reader (weights only, the same numbers for every
  engine), and again by `llama-perplexity --kl-divergence` on the same text (its protocol: BOS first in each
  chunk, the second half of each chunk scored; its figures against its own F16 file);
- weight MB a decode step reads (every weight but the embedding lookup, as the row runs it: packed bytes where
  packed; a tied LM head counts its table) and stored bits per weight of the decoder's linear layers (the
  checkpoint's own codes, scales and zero points; for a loom run-time method, its packed layout);
- single-stream decode tok/s (128 prompt tokens, 64 generated, median of 3), batch-32 output tok/s (32 requests
  of 128 + 64 at once) and prefill tok/s (one 512-token prompt: 512 / time to first token); llama.cpp's from
  `llama-bench` (pp512, tg64) and `llama-batched-bench` (32 sequences of 128 + 64) where built. Each loom row is
  timed in its own process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LLAMA_CPP_TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0")
GGUF_LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


@dataclass(slots=True)
class QuantEntry:
    """One row to measure."""

    label: str
    engine: str  # "loom" or "llama.cpp"
    model: str  # checkpoint directory or GGUF file
    quantization: str | None = None  # loom method; None = the checkpoint's default
    kv_cache_dtype: str = "auto"


@dataclass(slots=True)
class QuantRow:
    label: str
    engine: str
    quantization: str  # the method the row ran ("none" for llama.cpp files scored by loom's protocol)
    kv_cache_dtype: str
    perplexity: float
    perplexity_change_pct: float
    top1_agreement: float  # 0..1
    mean_kl: float  # nats
    weight_mb: float  # bytes a decode step reads (MB = 1e6): every weight but the embedding lookup, as run
    linear_bits: float | None  # stored bits per weight of the decoder's linear layers
    decode_tok_s: float | None = None
    batch32_output_tok_s: float | None = None
    prefill_tok_s: float | None = None
    # llama.cpp's own llama-perplexity figures (its protocol), for its rows
    llama_perplexity: float | None = None
    llama_kl: float | None = None
    llama_top1: float | None = None
    # for a llama.cpp row of a GGUF source: the share of its linear weight bytes that are the source's own, byte
    # for byte
    # (a type the source is already in comes back nearly unchanged: a round trip, not a quantization)
    source_identical: float | None = None


def checkpoint_linear_bits(path: str | Path) -> float | None:
    """Stored bits per weight of the decoder's linear layers of a checkpoint: a GGUF file (its tensors' bytes) or
    a safetensors directory (qweight + qzeros + scales + g_idx of GPTQ / AWQ layers, plain weights at their
    dtype); None when there is no linear layer to count."""
    path = Path(path)
    if path.is_file():
        from loom.model.loader.gguf import open_gguf

        reader = open_gguf(path)
        nbytes = weights = 0
        for t in reader.tensors:
            if GGUF_LINEAR.match(t.name):
                nbytes += int(t.n_bytes)
                weights += int(t.n_elements)
        return 8 * nbytes / weights if weights else None
    import math

    from safetensors import safe_open

    from loom.quant.gptq_checkpoint import LINEAR_NAMES

    meta: dict[str, tuple[list[int], str]] = {}  # tensor name -> (shape, dtype), every file read once
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                meta[name] = (t.get_shape(), t.get_dtype())
    item = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}
    nbytes = weights = 0
    for name, (shape, dtype) in meta.items():
        module, _, kind = name.rpartition(".")
        if module.rpartition(".")[2] not in LINEAR_NAMES or kind == "bias":
            continue
        nbytes += math.prod(shape) * item[dtype]
        if kind == "weight":
            weights += math.prod(shape)
        elif kind == "qweight":  # GPTQ [K * bits / 32, N] and AWQ [K, N * bits / 32] both hold K x N codes
            if f"{module}.g_idx" in meta:  # GPTQ: K from g_idx, N from scales [groups, N]
                weights += meta[f"{module}.g_idx"][0][0] * meta[f"{module}.scales"][0][1]
            elif f"{module}.scales" in meta:  # AWQ (4-bit): qweight [K, N / 8]
                weights += shape[0] * shape[1] * 8
            else:
                raise ValueError(f"{module}: a qweight without scales")
    return 8 * nbytes / weights if weights else None


def parse_checkpoint_arg(value: str) -> QuantEntry:
    """`LABEL=DIR` -> a loom entry run by the checkpoint's default method.

    Raises:
        ValueError: no "=", an empty label, a path that does not exist, or a file that is not GGUF.
    """
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"--checkpoint must be LABEL=DIR, got {value!r}")
    where = Path(path)
    if not where.exists():
        raise ValueError(f"--checkpoint {label}: {path!r} does not exist")
    if not (where.is_file() or (where / "config.json").is_file()):
        raise ValueError(f"--checkpoint {label}: {path!r} is neither a GGUF file nor a directory with config.json")
    if where.is_file():  # a file must be a GGUF one: say so here, naming the argument, not when it is loaded
        from loom.model.loader.gguf import open_gguf

        try:
            open_gguf(where)
        except ValueError as exc:
            raise ValueError(f"--checkpoint {label}: {exc}") from None
    return QuantEntry(label, "loom", path)


# ---------------------------------------------------------------- quality (loom's protocol)


def measure_quality(source: str | None, entries: list[QuantEntry], windows: list[list[int]]) -> list[dict[str, Any]]:
    """Perplexity, top-1 agreement, mean KL and weight MB of each entry against the float32 source, one
    process (quality does not depend on load); llama.cpp files are read as loom's quantization "none"."""
    import torch

    from loom.bench.quality import compare, force_kernel_path, window_logits
    from loom.model.loader import load_model
    from loom.model.loader.model_loader import default_quantization
    from loom.worker.model_runner import resolve_dtype

    cpu = torch.device("cpu")
    ref = load_model(source, torch.float32, cpu, quantization="none")
    reference = [window_logits(ref.model, ref.arch, w) for w in windows]
    vocab = ref.arch.vocab_size
    del ref
    out = []
    for entry in entries:
        method = "none" if entry.engine == "llama.cpp" else entry.quantization
        dtype = torch.float32 if method == "none" else resolve_dtype("auto", cpu, method, entry.model)
        loaded = load_model(entry.model, dtype, cpu, quantization=method)
        if loaded.arch.vocab_size != vocab:
            raise ValueError(f"{entry.label}: {loaded.arch.vocab_size} tokens, the source {vocab}: not the same model")
        force_kernel_path(loaded.model)
        logits = [window_logits(loaded.model, loaded.arch, w, kv_cache_dtype=entry.kv_cache_dtype) for w in windows]
        stats = compare(reference, logits, windows)
        if entry.engine == "llama.cpp":
            stats["weight_mb"] = gguf_decode_bytes(entry.model) / 1e6
            stats["linear_bits"] = checkpoint_linear_bits(entry.model)
        else:
            report = loaded.model.weight_report()
            stats["weight_mb"] = sum(n for kind, (_, n) in report.items() if kind != "embed_tokens") / 1e6
            # a checkpoint's own stored bits, except one stored dense and quantized at load (a smoothquant
            # checkpoint prepared for w8a8): the bits it runs with
            stats["linear_bits"] = (checkpoint_linear_bits(entry.model)
                                    if method is None and not _quantized_at_load(entry.model)
                                    else _runtime_linear_bits(loaded.model))
        stats["quantization"] = method or default_quantization(entry.model)
        out.append(stats)
        logger.info("%s: perplexity %.3f (%+.2f%%), KL %.5f", entry.label, stats["perplexity"],
                    stats["perplexity_change_pct"], stats["mean_kl"])
        del loaded
    return out


def gguf_decode_bytes(path: str | Path) -> int:
    """Bytes of the tensors a decode step reads from a GGUF file: all but the token embedding, which is read
    only when it is also the LM head (no output.weight) or for the few rows looked up."""
    from loom.model.loader.gguf import open_gguf

    tensors = {t.name: int(t.n_bytes) for t in open_gguf(Path(path)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if name != "token_embd.weight" or tied)


def source_identical_share(source: str | Path, quantized: str | Path) -> float:
    """Share (0..1) of the bytes of `quantized`'s decoder linear weights (GGUF_LINEAR) that are the tensor of the
    same name and type in the GGUF file `source`, byte for byte. llama-quantize of a source already in the
    requested types (Qwen2.5-Coder's Q4_K_M file to Q4_K_M) returns most tensors unchanged; its quality row then
    measures a round trip, not the type. (The embedding and LM head are left out: a type that keeps them at 8 bits
    returns an 8-bit source's table unchanged, which says nothing about the type's 4-bit part.)

    Raises:
        ValueError: either file is not a GGUF file (the gguf reader's error, named).
    """
    from loom.model.loader.gguf import open_gguf

    src = {t.name: t for t in open_gguf(Path(source)).tensors}
    same = total = 0
    for t in open_gguf(Path(quantized)).tensors:
        if not GGUF_LINEAR.match(t.name):
            continue
        n = int(t.n_bytes)
        total += n
        s = src.get(t.name)
        if s is not None and s.tensor_type == t.tensor_type and int(s.n_bytes) == n and bytes(s.data) == bytes(t.data):
            same += n
    return same / total if total else 0.0


ROUND_TRIP_SHARE = 0.5  # above this share of the source's own bytes a llama.cpp row is flagged as a round trip


def round_trip_notes(rows: list[QuantRow]) -> list[str]:
    """One line per llama.cpp row that is mostly the source's own bytes (source_identical > ROUND_TRIP_SHARE)."""
    return [f"- {r.label}: {100 * r.source_identical:.1f}% of its linear weight bytes are the source's own, byte for "
            f"byte (the source is already in this type's choices): a round trip, not a measure of the type."
            for r in rows if r.source_identical is not None and r.source_identical > ROUND_TRIP_SHARE]


def _quantized_at_load(path: str | Path) -> bool:
    """Whether a checkpoint directory is a dense one that `loom quantize` prepared for a run-time method
    (config.json's loom_quantization, e.g. smoothquant's w8a8)."""
    import json

    from loom.quant.quantize import prepared_method

    config = Path(path) / "config.json"
    return config.is_file() and prepared_method(json.loads(config.read_text())) is not None


def _runtime_linear_bits(model: Any) -> float | None:
    """Bits per weight of the decoder's linear layers as loom holds them (packed bytes where packed)."""
    report = model.weight_report()
    parts = [report[k] for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if k in report]
    weights = 0
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            weights += lin.input_size * sum(lin.output_sizes)
    return 8 * sum(n for _, n in parts) / weights if weights and parts else None


# ---------------------------------------------------------------- speed


@dataclass(frozen=True, slots=True)
class SpeedShape:
    """The three speed measurements' sizes (module docstring)."""

    decode_prompt: int = 128
    decode_output: int = 64
    prefill_prompt: int = 512
    batch: int = 32
    runs: int = 3  # timed runs of decode and prefill, after one warm-up


def loom_speed(entry: QuantEntry, vocab_size: int, shape: SpeedShape = SpeedShape()) -> dict[str, float]:
    """Decode, batch and prefill speed of one loom entry in this process (see the module docstring)."""
    from loom import LLM
    from loom.bench.datasets import synthetic_requests
    from loom.bench.latency import LatencyConfig, run_loom_latency
    from loom.bench.throughput import run_loom_throughput

    llm = LLM(model=entry.model, quantization=entry.quantization, kv_cache_dtype=entry.kv_cache_dtype)
    decode = run_loom_latency(llm, LatencyConfig(shape.decode_prompt, shape.decode_output, 1, shape.runs, seed=1),
                              vocab_size).summary()["decode_tok_s"]
    prefill = run_loom_latency(llm, LatencyConfig(shape.prefill_prompt, 2, 1, shape.runs, seed=2), vocab_size)
    batch = run_loom_throughput(llm, synthetic_requests(shape.batch, shape.decode_prompt, shape.decode_output,
                                                        vocab_size, seed=3), use_tqdm=False)
    return {"decode_tok_s": decode, "prefill_tok_s": shape.prefill_prompt / statistics.median(prefill.ttft_s),
            "batch32_output_tok_s": batch.output_tok_s}


def loom_speed_in_subprocess(entry: QuantEntry, vocab_size: int, shape: SpeedShape = SpeedShape(),
                             timeout_s: float = 1800) -> dict[str, float]:
    """loom_speed in a fresh interpreter (A/B runs in separate processes).

    Raises:
        RuntimeError: the worker failed (its stderr's tail in the message).
    """
    arg = json.dumps({"entry": asdict(entry), "vocab_size": vocab_size, "shape": asdict(shape)})
    proc = subprocess.run([sys.executable, "-m", "loom.bench.quant_report", arg], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{entry.label}: speed run failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- llama.cpp


@dataclass(slots=True)
class LlamaCpp:
    """llama.cpp's tools (benchmarks/install_peers.sh builds them) and its converter script."""

    bin_dir: Path
    converter: Path  # convert_hf_to_gguf.py
    threads: int = 2

    def exe(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: build it with benchmarks/install_peers.sh")
        return path

    def run(self, *args: Any, timeout: float = 3600) -> str:
        cmd = [str(a) for a in args]
        logger.info("$ %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "PYTHONPATH": str(self.converter.parent / "gguf-py")})
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
        return proc.stdout + proc.stderr


def export_hf_float32(source: str | None, out: Path) -> Path:
    """The source as a float32 Hugging Face checkpoint (transformers dequantizes a GGUF file's blocks), the input
    of llama.cpp's converter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom.model.loader.model_loader import resolve_model_path

    path = resolve_model_path(source)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    where = str(path.parent if path.is_file() else path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers will not save a model it loaded from GGUF
        del config.quantization_config
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(where, **kwargs).save_pretrained(str(out))
    return out


def llama_cpp_files(tools: LlamaCpp, source: str | None, work: Path, types: list[str]) -> dict[str, Path]:
    """F16 GGUF by llama.cpp's converter from the source's float32 export, then each of `types` by
    llama-quantize from the F16 file. Returns type -> file (F16 included); files already in `work` are reused."""
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "model-F16.gguf"
    if not f16.is_file():
        hf = export_hf_float32(source, work / "hf-float32")
        tools.run(sys.executable, tools.converter, hf, "--outtype", "f16", "--outfile", f16)
    files = {"F16": f16}
    for qtype in types:
        out = work / f"model-{qtype}.gguf"
        if not out.is_file():
            tools.run(tools.exe("llama-quantize"), f16, out, qtype, tools.threads)
        files[qtype] = out
    return files


def llama_perplexity(tools: LlamaCpp, files: dict[str, Path], text_file: Path, num_chunks: int, ctx: int,
                     work: Path) -> dict[str, dict[str, float]]:
    """llama-perplexity on `text_file`: the F16 file's logits saved as the KL base, then each type's perplexity,
    mean KL divergence and top-1 agreement ("Same top p") against it."""
    base = work / "f16.kld"
    common = ["-f", text_file, "-c", ctx, "--chunks", num_chunks, "-t", tools.threads]
    tools.run(tools.exe("llama-perplexity"), "-m", files["F16"], *common, "--kl-divergence-base", base)
    out = {}
    for qtype, path in files.items():
        if qtype == "F16":
            continue
        text = tools.run(tools.exe("llama-perplexity"), "-m", path, *common, "--kl-divergence-base", base,
                         "--kl-divergence")
        out[qtype] = parse_kl_divergence(text)
    return out


def parse_kl_divergence(text: str) -> dict[str, float]:
    """Mean PPL(Q), mean KLD and "Same top p" (percent) from llama-perplexity --kl-divergence's summary.

    Raises:
        ValueError: a figure is missing.
    """
    found = {}
    for key, pattern in (("perplexity", r"Mean\s+PPL\(Q\)\s*:\s*([0-9.]+)"),
                         ("mean_kl", r"Mean\s+KLD\s*:\s*([0-9.eE+-]+)"),
                         ("top1_pct", r"Same top p\s*:\s*([0-9.]+)")):
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"llama-perplexity output lacks {key!r} ({pattern})")
        found[key] = float(m.group(1))
    return found


def llama_speed(tools: LlamaCpp, path: Path) -> dict[str, float | None]:
    """llama-bench pp512 / tg64 and, where built, llama-batched-bench's output tok/s for 32 sequences."""
    text = tools.run(tools.exe("llama-bench"), "-m", path, "-t", tools.threads, "-p", 512, "-n", 64, "-r", 3,
                     "-o", "json")
    results = json.loads(text[text.index("[") : text.rindex("]") + 1])
    speed: dict[str, float | None] = {"batch32_output_tok_s": None}
    for r in results:
        if r.get("n_prompt") and not r.get("n_gen"):
            speed["prefill_tok_s"] = float(r["avg_ts"])
        elif r.get("n_gen") and not r.get("n_prompt"):
            speed["decode_tok_s"] = float(r["avg_ts"])
    if (tools.bin_dir / "llama-batched-bench").is_file():
        text = tools.run(tools.exe("llama-batched-bench"), "-m", path, "-t", tools.threads, "-c", 8192, "-b", 2048,
                         "-ub", 512, "-npp", 128, "-ntg", 64, "-npl", 32)
        speed["batch32_output_tok_s"] = batched_output_tok_s(text, 128, 64, 32)
    return speed


def batched_output_tok_s(text: str, prompt: int, output: int, batch: int) -> float | None:
    """Output tokens per second of the whole run (batch x output / T, prefill included, as loom's throughput
    counts them) from llama-batched-bench's table row PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[:3] == [str(prompt), str(output), str(batch)]:
            return batch * output / float(cells[8])
    return None


# ---------------------------------------------------------------- the table and the plot


def markdown_table(rows: list[QuantRow], reference_ppl: float) -> str:
    """The report's table (one line per row, markdown_row), then the round-trip notes."""
    lines = [f"Reference perplexity (float32, unquantized source): {reference_ppl:.3f}", "",
             "| row | engine | method | KV | weight MB | linear bits/w | perplexity | change | top-1 | mean KL | "
             "decode tok/s | batch-32 out tok/s | prefill tok/s | llama-perplexity PPL / KL / top-1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [markdown_row(r) for r in rows]
    notes = round_trip_notes(rows)
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def markdown_row(r: QuantRow) -> str:
    """One row of markdown_table."""
    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    llama = ("–" if r.llama_perplexity is None else
             f"{r.llama_perplexity:.3f} / {r.llama_kl:.5f} / {r.llama_top1:.2f}%")
    return (f"| {r.label} | {r.engine} | {r.quantization} | {r.kv_cache_dtype} | {r.weight_mb:.1f} | "
            f"{num(r.linear_bits, '.3f')} | {r.perplexity:.3f} | {r.perplexity_change_pct:+.2f}% | "
            f"{100 * r.top1_agreement:.2f}% | {_kl(r.mean_kl)} | {num(r.decode_tok_s, '.1f')} | "
            f"{num(r.batch32_output_tok_s, '.1f')} | {num(r.prefill_tok_s, '.1f')} | {llama} |")


def _kl(x: float) -> str:
    return f"{x:.5f}" if x == 0 or x >= 1e-3 else f"{x:.2e}"


def plot_rows(rows: list[QuantRow], out: Path, title: str) -> Path:
    """Mean KL against weight MB, one point per row (log KL), loom and llama.cpp in two markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for engine, marker in (("loom", "o"), ("llama.cpp", "s")):
        pts = [r for r in rows if r.engine == engine and r.mean_kl > 0]  # KL 0 (the reference) is off a log axis
        if not pts:
            continue
        ax.scatter([r.weight_mb for r in pts], [r.mean_kl for r in pts], marker=marker, label=engine)
        for r in pts:
            ax.annotate(r.label, (r.weight_mb, r.mean_kl), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("weight MB a decode step reads")
    ax.set_ylabel("mean KL vs unquantized (nats, log)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    """The speed worker: `python -m loom.bench.quant_report '{"entry": {...}, "vocab_size": N}'`."""
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    result = loom_speed(QuantEntry(**spec["entry"]), int(spec["vocab_size"]), SpeedShape(**spec["shape"]))
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
