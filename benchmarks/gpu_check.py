"""Device check for a machine with a GPU (issues 5, 9 and 14): parity and speed of loom on CUDA, in one short run.

The bundled GGUF (98 MB) is larger than what travels to the device machine, so this script builds its own
models: tiny random Llama and Qwen2 checkpoints with a generated word-level tokenizer for the parity check
(greedy tokens equal transformers' in float32 on the same device, TF32 off; the engine's executor recorded),
and a random-weight model of SmolLM2-135M's shape for latency and throughput in bfloat16, loom vs transformers
`generate`; and torch's 2:4 semi-structured sparse matmul against dense (issue 12). The packed checks (issue 9
item 5) read a real GGUF given by --gguf: the bundled model cut to its
first blocks by benchmarks/gguf_truncate.py travels (about 50 MB for 8 blocks).

Each section's result, or its traceback, is written to --out as soon as it ends, so a run cut short still
reports what it reached. Run it anywhere: it uses CUDA when present, else the CPU (smaller shapes):
    python benchmarks/gguf_truncate.py /tmp/smollm2-8.gguf --layers 8
    python benchmarks/gpu_check.py --gguf /tmp/smollm2-8.gguf --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch


def _tokenizer(directory: Path, vocab_size: int):  # noqa: ANN202 - a transformers tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(directory)
    return fast


def _save_model(directory: Path, architecture: str, vocab_size: int, **shape: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        architecture]
    torch.manual_seed(0)
    config = config_cls(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **shape)
    model_cls(config).save_pretrained(directory, safe_serialization=True)
    _tokenizer(directory, vocab_size)
    return directory


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    past, out_tokens = None, []
    for _ in range(new_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        out_tokens.append(token)
        ids = torch.tensor([[token]], device=device)
    return out_tokens


def check_parity(root: Path, device: torch.device) -> dict[str, bool]:
    """fp32 greedy tokens of loom vs transformers on tiny random Llama / Qwen2, 8 prompts x 32 tokens."""
    from transformers import AutoModelForCausalLM

    from loom import LLM, SamplingParams

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    prompts = [[3 + (7 * i + 11 * j) % 900 for i in range(5 + 3 * j)] for j in range(8)]
    results = {}
    for arch in ("llama", "qwen2"):
        directory = _save_model(root / arch, arch, 1000, **shape)
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
        expected = [_hf_greedy(hf, p, 32, device) for p in prompts]
        llm = LLM(model=str(directory), dtype="float32", num_kv_blocks=512)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        results[arch] = got == expected
        results[f"{arch}_tokens_equal"] = sum(g == e for g, e in zip(got, expected))
        results["executor"] = type(llm.engine.executor).__name__
        results["runner_device"] = str(llm.engine.runner.device)
        del hf, llm
    return results


def bench(root: Path, device: torch.device, full: bool) -> dict[str, float]:
    """bf16 decode TPOT (1 request) and batched throughput (32 x 128/128), loom vs transformers."""
    from transformers import AutoModelForCausalLM

    from loom import LLM, SamplingParams

    shape = (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
             if full else dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True))
    vocab = 49152 if full else 1000
    prompt_len, new, batch = (512, 128, 32) if full else (32, 16, 4)
    directory = _save_model(root / "smollm2-shape", "llama", vocab, **shape)
    prompt = [3 + i % (vocab - 3) for i in range(prompt_len)]
    batch_prompts = [[3 + (i * 13 + j) % (vocab - 3) for i in range(128 if full else 16)] for j in range(batch)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    llm = LLM(model=str(directory), dtype="bfloat16")
    one = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)  # warm-up
    runs = []
    for k in range(3):
        p = [(k + 5) % vocab] + prompt[1:]  # a fresh first token: no prefix-cache hit
        sync(); t0 = time.perf_counter(); llm.generate([p], first, use_tqdm=False); sync()
        ttft = time.perf_counter() - t0
        p = [(k + 9) % vocab] + prompt[1:]
        sync(); t0 = time.perf_counter(); llm.generate([p], one, use_tqdm=False); sync()
        runs.append((time.perf_counter() - t0 - ttft) / (new - 1))
    loom_tpot = statistics.median(runs)
    batch_params = SamplingParams(temperature=0.0, max_tokens=128 if full else 16, ignore_eos=True)
    sync(); t0 = time.perf_counter(); llm.generate(batch_prompts, batch_params, use_tqdm=False); sync()
    loom_batch_s = time.perf_counter() - t0
    del llm

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
    gen = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new)
    ids = torch.tensor([prompt], device=device)
    hf.generate(ids, **gen)
    hf_runs = []
    for _ in range(3):
        sync(); t0 = time.perf_counter(); hf.generate(ids, do_sample=False, max_new_tokens=1); sync()
        ttft = time.perf_counter() - t0
        sync(); t0 = time.perf_counter(); hf.generate(ids, **gen); sync()
        hf_runs.append((time.perf_counter() - t0 - ttft) / (new - 1))
    hf_tpot = statistics.median(hf_runs)
    batch_ids = torch.tensor(batch_prompts, device=device)
    out_new = 128 if full else 16
    sync(); t0 = time.perf_counter()
    hf.generate(batch_ids, attention_mask=torch.ones_like(batch_ids), do_sample=False, min_new_tokens=out_new,
                max_new_tokens=out_new)
    sync(); hf_batch_s = time.perf_counter() - t0
    return {"loom_tpot_ms": loom_tpot * 1e3, "hf_tpot_ms": hf_tpot * 1e3, "tpot_speedup": hf_tpot / loom_tpot,
            "loom_batch_s": loom_batch_s, "hf_batch_s": hf_batch_s, "batch_speedup": hf_batch_s / loom_batch_s}


def _prose_tokens(model: str | None, count: int) -> list[int]:
    """`count` tokens of English prose (this file's docstrings, repeated) in the model's own tokenizer."""
    from loom.model.loader import load_tokenizer

    text = " ".join((__doc__ or "").split()) + " " + " ".join((check_packed.__doc__ or "").split())
    ids = load_tokenizer(model).encode(text)
    return (ids * (count // max(len(ids), 1) + 1))[:count]


def check_packed(device: torch.device, model: str | None, tokens: list[int]) -> dict[str, float]:
    """Issue 9 item 5: a real GGUF run packed (quantization gguf, and w8a16 / w4a16 / w8a8 / fp8 quantized at load;
    torch kernels on a GPU) against its dequantized float32 path on the same device: top-1 agreement and mean KL
    divergence (nats; loom.bench.quality.compare) and max |logit difference| over one window of prose `tokens`, and
    the window's time."""
    from loom.bench.quality import compare, force_kernel_path, window_logits
    from loom.model.loader import load_model

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ref = load_model(model, torch.float32, device, quantization="none")
    ref_logits = window_logits(ref.model, ref.arch, tokens)
    del ref
    out: dict[str, float] = {}
    for method in ("gguf", "w8a16", "w4a16", "w8a8", "fp8"):
        try:
            loaded = load_model(model, torch.float32, device, quantization=method)
            force_kernel_path(loaded.model)
            window_logits(loaded.model, loaded.arch, tokens[:32])  # warm-up
            sync(); t0 = time.perf_counter()
            logits = window_logits(loaded.model, loaded.arch, tokens)
            sync(); out[f"{method}_window_ms"] = (time.perf_counter() - t0) * 1e3
            quality = compare([ref_logits.cpu()], [logits.cpu()], [tokens])
            out[f"{method}_top1"] = quality["top1_agreement"]
            out[f"{method}_mean_kl"] = quality["mean_kl"]
            out[f"{method}_max_abs_logit_diff"] = float((logits - ref_logits).abs().max())
            out[f"{method}_param_device"] = str(next(loaded.model.parameters()).device)
            del loaded
        except Exception:  # noqa: BLE001 - one method's failure is a result; the others still run
            out[f"{method}_error"] = traceback.format_exc()[-2000:]
    return out


def engine_packed(model: str | None, tokens: list[int]) -> dict[str, object]:
    """The engine on this device with the GGUF packed (quantization gguf) and dequantized (none), float32: greedy
    tokens of 4 prose prompts x 32 (how many equal), single-stream TPOT and a batch of 16, each path; `tokens`:
    at least 304 tokens of prose."""
    from loom import LLM, SamplingParams

    prompts = [tokens[i * 40:i * 40 + 24 + 8 * i] for i in range(4)]
    batch = [tokens[i * 16:i * 16 + 64] for i in range(16)]
    out: dict[str, object] = {}
    got = {}
    for method in ("gguf", "none"):
        llm = LLM(model=model, dtype="float32", quantization=method)
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        got[method] = [o.outputs[0].token_ids for o in outs]
        out[f"{method}_finish_reasons"] = sorted({str(o.outputs[0].finish_reason) for o in outs})
        if any(len(t) != 32 for t in got[method]):
            raise RuntimeError(f"quantization {method}: greedy outputs of lengths {[len(t) for t in got[method]]}, "
                               f"finish reasons {out[f'{method}_finish_reasons']}")
        long = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        runs = []
        for k in range(3):
            t0 = time.perf_counter(); llm.generate([[k + 7] + prompts[0]], one, use_tqdm=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter(); llm.generate([[k + 11] + prompts[0]], long, use_tqdm=False)
            runs.append((time.perf_counter() - t0 - ttft) / 64)
        out[f"{method}_tpot_ms"] = statistics.median(runs) * 1e3
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        out[f"{method}_batch16_tok_s"] = 16 * 64 / (time.perf_counter() - t0)
        out[f"{method}_executor"] = type(llm.engine.executor).__name__
        out[f"{method}_device"] = str(llm.engine.runner.device)
        llm.engine.shutdown()
        del llm
    out["greedy_prompts_equal"] = sum(a == b for a, b in zip(got["gguf"], got["none"]))
    out["greedy_first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                      for a, b in zip(got["gguf"], got["none"])]
    return out


def sparse24(device: torch.device) -> dict[str, object]:
    """Issue 12 item 5 on a GPU: torch's semi-structured (2:4) sparse matmul against the dense one, float16, on
    SmolLM2's matrices and two of Llama-3-8B's, at decode and prefill row counts. The weight is pruned 2:4 by
    magnitude (loom.quant.sparsity.prune_24); the sparse product must equal the pruned dense one to float16
    rounding. Medians of CUDA-event timings. CUDA only (no CPU kernel exists for the format)."""
    if device.type != "cuda":
        return {"skipped": "CUDA only"}
    from torch.sparse import to_sparse_semi_structured

    from loom.quant.sparsity import prune_24

    def timed(fn, reps: int = 50) -> float:  # noqa: ANN001 - a callable
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    out: dict[str, object] = {}
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, (n, k) in {"smollm2_gate_up": (3072, 576), "smollm2_down": (576, 1536),
                         "llama8b_qkv": (6144, 4096), "llama8b_gate_up": (28672, 4096)}.items():
        w = torch.randn(n, k, generator=g).to(device, torch.float16)
        pruned = prune_24(w, w.abs())
        sparse = to_sparse_semi_structured(pruned)
        for m in (1, 16, 128, 2048):
            x = torch.randn(m, k, generator=g).to(device, torch.float16)
            ref = torch.nn.functional.linear(x, pruned)
            got = torch.nn.functional.linear(x, sparse)
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            dense_ms = timed(lambda x=x: torch.nn.functional.linear(x, pruned))
            sparse_ms = timed(lambda x=x: torch.nn.functional.linear(x, sparse))
            out[f"{name} [{n},{k}] M={m}"] = {"dense_ms": round(dense_ms, 4), "sparse_ms": round(sparse_ms, 4),
                                             "speedup": round(dense_ms / sparse_ms, 3), "max_rel_err": err}
    return out


def _run_section(results: dict, name: str, fn, out: Path | None) -> None:  # noqa: ANN001 - any callable
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - a failed section is reported; the rest still run
        results[name] = {"error": traceback.format_exc()[-3000:]}
    results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(json.dumps({name: results[name]}, indent=2), flush=True)
    if out:
        out.write_text(json.dumps(results, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--small", action="store_true", help="small shapes even on a GPU (a quick self-check)")
    parser.add_argument("--gguf", default=None, help="the GGUF for the packed checks (default: the bundled model)")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out "
                        "(parity_fp32, bench_bf16, packed_vs_dequantized, engine_packed, sparse24)")
    ns = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means real fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    import transformers

    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                  "torch": torch.__version__, "transformers": transformers.__version__}
    skip = set(filter(None, ns.skip.split(",")))
    prose = _prose_tokens(ns.gguf, 512)  # the packed checks' text, tokenized once
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        sections = {
            "parity_fp32": lambda: check_parity(Path(tmp), device),
            "packed_vs_dequantized": lambda: check_packed(device, ns.gguf, prose[:256]),
            "engine_packed": lambda: engine_packed(ns.gguf, prose),
            "bench_bf16": lambda: bench(Path(tmp), device, full=device.type == "cuda" and not ns.small),
            "sparse24": lambda: sparse24(device),
        }
        for name, fn in sections.items():
            if name not in skip:
                _run_section(results, name, fn, ns.out)
        results["seconds"] = time.perf_counter() - t0
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=2))
    parity = results.get("parity_fp32", {})
    return 0 if isinstance(parity, dict) and parity.get("llama") and parity.get("qwen2") else 1


if __name__ == "__main__":
    raise SystemExit(main())
