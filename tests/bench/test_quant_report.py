"""`loom bench quant` (loom/bench/quant_report.py) on a tiny model: the rows, the columns, the files; the parts
that read llama.cpp's output on captured text (llama.cpp itself is a benchmark peer, never built by tests)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loom.bench import quant_report as qr
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, hf_tokenizer) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("quant_report") / "tiny", "llama", hf_tokenizer, seed=3)


def _prose(tmp_path: Path) -> Path:
    rng = random.Random(0)
    words = "the a house letter sister walk ball evening morning said was very much to of and in".split()
    path = tmp_path / "prose.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)) + "\n")
    return path


def test_bench_quant_writes_one_row_per_format(tiny_with_tokenizer, tmp_path) -> None:
    from loom.quant.gptq_checkpoint import GPTQSettings, write_gptq_checkpoint

    ckpt = tmp_path / "rtn8"
    write_gptq_checkpoint(str(tiny_with_tokenizer), str(ckpt), GPTQSettings("rtn", 8, 32, True, False), [])
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "loom.cli", "bench", "quant", "--model", str(tiny_with_tokenizer),
           "--methods", "none", "w8a16", "--kv-cache-dtypes", "int8", "--kv-with", "none",
           "--checkpoint", f"rtn8={ckpt}", "--text-file", str(_prose(tmp_path)), "--num-windows", "2",
           "--window-len", "64", "--no-speed", "--result-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "quant.json").read_text())
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == ["none", "w8a16", "none + KV int8", "rtn8"]
    assert rows["none"]["mean_kl"] == 0 and rows["none"]["top1_agreement"] == 1.0
    assert rows["none"]["linear_bits"] == pytest.approx(32.0)  # float32, as loom holds it
    for label in ("w8a16", "none + KV int8", "rtn8"):  # each perturbs, a little
        assert 0 < rows[label]["mean_kl"] < 0.05, label
    assert rows["none + KV int8"]["kv_cache_dtype"] == "int8" and rows["none + KV int8"]["linear_bits"] == 32.0
    assert rows["rtn8"]["quantization"] == "gptq"
    # the checkpoint's own bytes: 8-bit codes, a float16 scale and an 8-bit zero per 32 columns, g_idx per column
    cfg = json.loads((tiny_with_tokenizer / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    mats = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # (K, N) per projection
    bits = sum(k * n * 8 + (k // 32) * n * 24 + k * 32 for k, n in mats) / sum(k * n for k, n in mats)
    assert rows["rtn8"]["linear_bits"] == pytest.approx(bits)
    assert rows["rtn8"]["weight_mb"] < rows["none"]["weight_mb"]
    assert all(r["decode_tok_s"] is None for r in rows.values())
    table = (out / "quant.md").read_text()
    assert table.count("\n| ") == 1 + len(rows)  # header + one line per row
    assert (out / "quant.png").stat().st_size > 0


def test_speed_runs_in_its_own_process(tiny_with_tokenizer) -> None:
    entry = qr.QuantEntry("w8a16", "loom", str(tiny_with_tokenizer), "w8a16")
    shape = qr.SpeedShape(decode_prompt=16, decode_output=8, prefill_prompt=64, batch=4, runs=1)
    speed = qr.loom_speed_in_subprocess(entry, 49152, shape, timeout_s=300)
    assert set(speed) >= {"decode_tok_s", "prefill_tok_s", "batch32_output_tok_s"}
    assert all(speed[k] > 0 for k in ("decode_tok_s", "prefill_tok_s", "batch32_output_tok_s"))
    with pytest.raises(RuntimeError, match="speed run failed"):
        qr.loom_speed_in_subprocess(qr.QuantEntry("bad", "loom", str(tiny_with_tokenizer), "w8a16", "int9"),
                                    49152, shape, timeout_s=300)


def test_checkpoint_argument_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="LABEL=DIR"):
        qr.parse_checkpoint_arg("just-a-path")
    with pytest.raises(ValueError, match="does not exist"):
        qr.parse_checkpoint_arg(f"x={tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="neither a GGUF file nor a directory with config.json"):
        qr.parse_checkpoint_arg(f"x={tmp_path}")
    (tmp_path / "config.json").write_text("{}")
    assert qr.parse_checkpoint_arg(f"x={tmp_path}").model == str(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("not a model at all\n" * 10)
    with pytest.raises(ValueError, match=r"^--checkpoint foo: .*not a GGUF file"):
        qr.parse_checkpoint_arg(f"foo={text}")


def test_gguf_bits_and_decode_bytes_come_from_the_file(default_gguf) -> None:
    from loom.model.loader.gguf import open_gguf

    tensors = {t.name: t for t in open_gguf(default_gguf).tensors}
    linear = [t for name, t in tensors.items() if qr.GGUF_LINEAR.match(name)]
    assert len(linear) == 30 * 7
    assert qr.checkpoint_linear_bits(default_gguf) == pytest.approx(5.0, abs=0.01)  # Q4_1: 4 bits + 2 fp16 / 32
    # tied embeddings (no output.weight): the table is read as the LM head, so it counts
    assert "output.weight" not in tensors
    assert qr.gguf_decode_bytes(default_gguf) == sum(int(t.n_bytes) for t in tensors.values())


# captured from llama-perplexity --kl-divergence (llama.cpp of llama-cpp-python 0.3.36; SmolLM2 Q4_K_M against its
# F16 file, 2 chunks of 512 tokens of Pride and Prejudice, 2026-12-02)
LLAMA_KL_OUTPUT = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  18.746974 ±   2.191482
Mean PPL(base)                :  17.982936 ±   2.058517
Cor(ln(PPL(Q)), ln(PPL(base))):  99.23%
Mean ln(PPL(Q)/PPL(base))     :   0.041609 ±   0.014517
Mean PPL(Q)/PPL(base)         :   1.042487 ±   0.015134
Mean PPL(Q)-PPL(base)         :   0.764039 ±   0.294524

====== KL divergence statistics ======
Mean    KLD:   0.046540 ±   0.001979
Maximum KLD:   0.459519
99.9%   KLD:   0.381869
99.0%   KLD:   0.210953
95.0%   KLD:   0.123716
90.0%   KLD:   0.089935
Median  KLD:   0.034694
10.0%   KLD:   0.006008
 5.0%   KLD:   0.001779
 1.0%   KLD:   0.000193
 0.1%   KLD:   0.000068
Minimum KLD:   0.000058

====== Token probability statistics ======
Mean    Δp: -0.220 ± 0.182 %
Maximum Δp: 16.177%
99.9%   Δp: 15.174%
99.0%   Δp: 12.386%
95.0%   Δp:  6.108%
90.0%   Δp:  3.661%
75.0%   Δp:  0.597%
Median  Δp: -0.009%
25.0%   Δp: -1.054%
10.0%   Δp: -3.954%
 5.0%   Δp: -7.221%
 1.0%   Δp: -13.460%
 0.1%   Δp: -20.331%
Minimum Δp: -23.679%
RMS Δp    :  4.113 ± 0.250 %
Same top p: 85.882 ± 1.543 %
"""


def test_llama_perplexity_summary_is_parsed() -> None:
    assert qr.parse_kl_divergence(LLAMA_KL_OUTPUT) == {"perplexity": 18.746974, "mean_kl": 0.046540,
                                                       "top1_pct": 85.882}
    with pytest.raises(ValueError, match="lacks 'mean_kl'"):
        qr.parse_kl_divergence(LLAMA_KL_OUTPUT.replace("Mean    KLD", "Mode    KLD"))


def test_kv_cache_dtype_reaches_the_quality_logits(tiny_with_tokenizer) -> None:
    from loom.bench.quality import window_logits
    from loom.model.loader import load_model

    m = load_model(str(tiny_with_tokenizer), torch.float32, torch.device("cpu"), quantization="none")
    tokens = list(range(100, 164))
    exact = window_logits(m.model, m.arch, tokens)
    int8 = window_logits(m.model, m.arch, tokens, kv_cache_dtype="int8")
    assert not torch.equal(exact, int8)  # the prefill read its keys and values back from the int8 cache
    torch.testing.assert_close(int8, exact, rtol=0.05, atol=0.05)


def test_batched_bench_row_gives_output_tokens_over_the_whole_run() -> None:
    # llama-batched-bench's table (llama.cpp of llama-cpp-python 0.3.36, SmolLM2 Q4_K_M, 2 threads)
    text = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    4 |    768 |    1.898 |   269.75 |    2.865 |    89.35 |    4.763 |   161.24 |
"""
    assert qr.batched_output_tok_s(text, 128, 64, 4) == pytest.approx(4 * 64 / 4.763)
    assert qr.batched_output_tok_s(text, 128, 64, 32) is None


@pytest.mark.parametrize(("args", "message"), [
    (["--num-windows", "0"], "--num-windows: must be >= 1"),
    (["--threads", "0"], "--threads: must be >= 1"),
    (["--llama-cpp", "/nonexistent"], "--llama-cpp: /nonexistent/llama-quantize is missing"),
    (["--checkpoint", "none=."], "labels must differ"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args: list[str], message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = [a.replace("=.", f"={tmp_path}") for a in args]
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "quant", "--methods", "none", "--no-speed",
                           *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--num-windows", "0"], "--num-windows: must be >= 1"),
    (["--window-len", "1"], "--window-len: must be >= 2"),
    (["--skip-tokens", "-5"], "--skip-tokens: must be >= 0"),
])
def test_bench_quality_bad_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    """Refused by the parser (a ZeroDivisionError traceback after loading the model, or a slice from the end for a
    negative skip, before: fresh-user trial)."""
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "quality", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--methods", "--kv-cache-dtypes"], "nothing to measure: give --methods"),
    (["--methods", "none", "--window-len", "100000"], "--window-len 100000 is longer than the model's context (8192"),
    (["--methods", "none", "--result-dir", "{tmp}/afile/sub"], "--result-dir '{tmp}/afile/sub' cannot be written"),
])
def test_what_would_fail_after_the_measuring_is_refused_before_it(tmp_path, args: list[str], message: str) -> None:
    """No rows (an IndexError traceback after loading the tokenizer), a window past the model's context (an error
    from the first forward pass, naming no option) and a result directory that cannot be made (an error after every
    row was measured: the work lost) are refused up front (fresh-user trial, 2026-12-06)."""
    (tmp_path / "afile").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "quant", "--no-speed", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and message.replace("{tmp}", str(tmp_path)) in proc.stderr
    assert "Traceback" not in proc.stderr and "perplexity" not in proc.stdout + proc.stderr  # nothing was measured


def test_bench_quality_refuses_a_window_past_the_context() -> None:
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "quality", "--num-windows", "1",
                           "--window-len", "9000"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "--window-len 9000 is longer than the model's context (8192" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_result_dir_that_is_a_file_is_refused(tmp_path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "quant", "--result-dir", str(afile)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_checkpoint_quantized_at_load_reports_the_bits_it_runs_with(tmp_path, default_gguf) -> None:
    """A smoothquant checkpoint is float32 on disk but runs as w8a8: its row's linear bits are w8a8's, not 32
    (the 2026-12-06 report showed 32.000 beside w8a8's 138 MB)."""
    (tmp_path / "config.json").write_text(json.dumps({"loom_quantization": {"method": "w8a8"}}))
    assert qr._quantized_at_load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert not qr._quantized_at_load(tmp_path)
    assert not qr._quantized_at_load(default_gguf)


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, "gguf.GGMLQuantizationType"]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_llama_cpp_file_that_returns_the_sources_bytes_is_a_round_trip(tmp_path) -> None:
    q8, q4, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                   gguf.GGMLQuantizationType.F32)
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((4, 64)) for _ in range(3))
    names = [f"blk.0.{p}.weight" for p in ("attn_q", "attn_k", "ffn_up")]
    src = _write_gguf(tmp_path / "src.gguf", {names[0]: (a, q8), names[1]: (b, q8), "token_embd.weight": (c, q8),
                                              "blk.0.attn_norm.weight": (a[0], f32)})
    # attn_q kept byte for byte, attn_k re-quantized to another type, ffn_up new; the embedding (the same bytes
    # in both) and the F32 norm are not decoder linear weights and do not count
    out = _write_gguf(tmp_path / "out.gguf", {names[0]: (a, q8), names[1]: (b, q4), names[2]: (c, q8),
                                              "token_embd.weight": (c, q8), "blk.0.attn_norm.weight": (a[0], f32)})
    q8_bytes, q4_bytes = 4 * 2 * (2 + 32), 4 * 2 * (2 + 16)  # rows x blocks x (fp16 scale + codes)
    share = qr.source_identical_share(src, out)
    assert share == pytest.approx(q8_bytes / (q8_bytes + q4_bytes + q8_bytes))
    assert qr.source_identical_share(src, src) == 1.0
    # the same type with other values is not the source's bytes
    other = _write_gguf(tmp_path / "other.gguf", {names[0]: (a + 1, q8), names[1]: (b, q8)})
    assert qr.source_identical_share(src, other) == pytest.approx(0.5)
    row = qr.QuantRow("llama.cpp Q4_K_M", "llama.cpp", "none", "auto", 10.0, 0.1, 0.99, 0.004, 100.0, 5.5,
                      source_identical=0.97)
    plain = qr.QuantRow("llama.cpp Q4_0", "llama.cpp", "none", "auto", 11.0, 8.0, 0.8, 0.1, 90.0, 4.5,
                        source_identical=0.0)
    table = qr.markdown_table([row, plain], 10.0)
    assert "- llama.cpp Q4_K_M: 97.0% of its linear weight bytes are the source's own" in table
    assert "llama.cpp Q4_0:" not in table
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        qr.source_identical_share(src, tmp_path / "notes.txt")
