"""Device check for a machine with a GPU (issue 5): parity and speed of loom on CUDA, in one short run.

The bundled GGUF (98 MB) is larger than what travels to the device machine, so this script builds its own
models: tiny random Llama and Qwen2 checkpoints with a generated word-level tokenizer for the parity check
(greedy tokens equal transformers' in float32 on the same device, TF32 off), and a random-weight model of
SmolLM2-135M's shape for latency and throughput in bfloat16, loom vs transformers `generate`.

Run it anywhere: it uses CUDA when present, else the CPU (smaller shapes, to check the script itself):
    python benchmarks/gpu_check.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
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


def check_packed(device: torch.device) -> dict[str, float]:
    """Issue 9 item 5: the bundled GGUF run packed (quantization gguf, torch kernels on a GPU) against its dequantized
    float32 path on the same device: top-1 agreement and max |logit difference| over one 256-token window."""
    from loom.bench.quality import force_kernel_path, window_logits
    from loom.model.loader import load_model

    tokens = [(i * 7919) % 49152 for i in range(256)]
    ref = load_model(None, torch.float32, device, quantization="none")
    ref_logits = window_logits(ref.model, ref.arch, tokens)
    del ref
    out: dict[str, float] = {}
    for method in ("gguf", "w8a16", "w4a16", "w8a8"):
        loaded = load_model(None, torch.float32, device, quantization=method)
        force_kernel_path(loaded.model)
        logits = window_logits(loaded.model, loaded.arch, tokens)
        out[f"{method}_top1"] = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        out[f"{method}_max_abs_logit_diff"] = float((logits - ref_logits).abs().max())
        del loaded
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--small", action="store_true", help="small shapes even on a GPU (a quick self-check)")
    ns = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means real fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        results["parity_fp32"] = check_parity(Path(tmp), device)
        results["bench_bf16"] = bench(Path(tmp), device, full=device.type == "cuda" and not ns.small)
        results["packed_vs_dequantized"] = check_packed(device)
        results["seconds"] = time.perf_counter() - t0
    print(json.dumps(results, indent=2))
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=2))
    return 0 if all(results["parity_fp32"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
