"""`loom bench quality`: a quantized path against the dequantized float32 path on held-out prose.

Teacher-forced: the same token windows go through each model in one prefill; at every position we compare the
next-token distributions. Reported per method: perplexity (exp of the mean NLL of the true next token),
top-1 agreement with the reference (the share of positions whose argmax equals the reference's argmax), and
the mean KL divergence KL(reference || method) in nats (the measure llama.cpp's `perplexity --kl-divergence`
reports). Windows: consecutive non-overlapping `window_len` tokens, no BOS, window_len - 1 predictions each.

Every row goes through the decode-path kernels (int8 activations for gguf / w8a8), not the dequantize + GEMM
path that prefill takes above `dense_min_rows` rows (loom/quant/methods.py): the packed kernels compute each
row on its own, so a window's rows score exactly what single-token decode steps would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.attention import build_attention_metadata
from loom.worker.kv_cache import allocate_kv_caches


@dataclass(slots=True)
class QualityResult:
    quantization: str  # method name
    dtype: str  # activation dtype
    num_predictions: int  # positions scored
    perplexity: float
    perplexity_change_pct: float  # vs the reference, percent
    top1_agreement: float  # share of positions with the reference's argmax, 0..1
    mean_kl: float  # nats, KL(reference || this)
    weight_mb: float  # MB a decode step reads


@torch.inference_mode()
def window_logits(model: torch.nn.Module, arch: object, tokens: list[int], block_size: int = 16,
                  kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits [len(tokens), vocab] float32 of one sequence computed in one prefill over a fresh paged cache of
    `kv_cache_dtype` (loom.attention.kv_quant: "auto" = what the engine stores for this model: float16 under
    packed weights on the CPU, else the model dtype; "int8", "fp8_e4m3", ...). Prefill attention reads its keys
    and values back from the cache (loom/attention/cpu_paged.py), so a 16-bit or quantized cache's rounding is in
    every position's logits, as it is in decode."""
    from loom.attention.kv_quant import resolve_kv_cache_dtype
    from loom.worker.model_runner import packed_on_cpu

    num_blocks = -(-len(tokens) // block_size)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # the engine's test (model_runner.packed_on_cpu), from the loaded model's quantization config
    method = getattr(getattr(model, "quant_config", None), "name", None)
    packed_cpu = method is not None and packed_on_cpu(device, method, None)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, packed_cpu=packed_cpu)
    caches = allocate_kv_caches(arch, num_blocks, block_size, kv_dtype, device)
    meta = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(num_blocks))], block_size, device)
    hidden = model(torch.tensor(tokens, device=device), torch.arange(len(tokens), device=device), caches, meta)
    return model.compute_logits(hidden).float()


def force_kernel_path(model: torch.nn.Module) -> None:
    """Make every packed layer use its decode kernels at any number of rows."""
    from loom.quant.methods import PackedLinearMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, PackedLinearMethod):
            method.dense_min_rows = 1 << 62


def token_windows(token_ids: list[int], num_windows: int, window_len: int,
                  max_position: int | None = None) -> list[list[int]]:
    """The first `num_windows` consecutive windows of `window_len` tokens.

    Raises:
        ValueError: the text is too short, or window_len is above max_position (the model's context, when given).
    """
    if max_position is not None and window_len > max_position:
        raise ValueError(f"--window-len {window_len} is longer than the model's context ({max_position} positions)")
    if len(token_ids) < num_windows * window_len:
        raise ValueError(f"held-out text has {len(token_ids)} tokens, fewer than {num_windows} x {window_len}")
    return [token_ids[i * window_len : (i + 1) * window_len] for i in range(num_windows)]


def compare(reference: list[torch.Tensor], other: list[torch.Tensor], windows: list[list[int]]) -> dict[str, float]:
    """Perplexities, top-1 agreement and mean KL of `other` against `reference` (lists of [n, V] logits)."""
    nll_ref = nll = kl = agree = count = 0.0
    for ref, oth, toks in zip(reference, other, windows, strict=True):
        target = torch.tensor(toks[1:])
        lp_ref = F.log_softmax(ref[:-1].double(), dim=-1)
        lp = F.log_softmax(oth[:-1].double(), dim=-1)
        nll_ref += float(-lp_ref.gather(1, target[:, None]).sum())
        nll += float(-lp.gather(1, target[:, None]).sum())
        kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
        agree += float((ref[:-1].argmax(-1) == oth[:-1].argmax(-1)).sum())
        count += len(toks) - 1
    ppl_ref, ppl = math.exp(nll_ref / count), math.exp(nll / count)
    return {"num_predictions": int(count), "perplexity_ref": ppl_ref, "perplexity": ppl,
            "perplexity_change_pct": 100 * (ppl / ppl_ref - 1), "top1_agreement": agree / count,
            "mean_kl": kl / count}


def run_quality(model: str | None, methods: list[str], dtype: str, windows: list[list[int]],
                reference_model: str | None = None) -> list[QualityResult]:
    """Each method's logits on `windows` against quantization "none" in float32 of `reference_model` (default:
    `model` itself; another checkpoint of the same model, e.g. the source of a `loom quantize` output).

    Raises:
        ValueError: the reference's vocabulary differs from the model's.
    """
    from loom.model.loader import load_model
    from loom.quant.config import AlreadyQuantizedError
    from loom.worker.model_runner import resolve_dtype

    device = torch.device("cpu")
    try:
        ref_model = load_model(model if reference_model is None else reference_model, torch.float32, device,
                               quantization="none")
    except AlreadyQuantizedError:
        if reference_model is not None:
            raise
        # a pre-quantized checkpoint (GPTQ, AWQ, ...) has no float32 weights of its own to be the reference
        raise ValueError(f"reference_model: {model} holds quantized weights, so it cannot be its own float32 "
                         "reference; pass its source as --reference-model (for a `loom quantize` output of the "
                         "bundled model: the bundled GGUF)") from None
    reference = [window_logits(ref_model.model, ref_model.arch, w) for w in windows]
    results = []
    for method in methods:
        torch_dtype = resolve_dtype(dtype, device, method, model)
        loaded = load_model(model, torch_dtype, device, quantization=method)
        if loaded.arch.vocab_size != ref_model.arch.vocab_size:
            raise ValueError(f"reference_model has {ref_model.arch.vocab_size} tokens, the model "
                             f"{loaded.arch.vocab_size}: not the same model")
        force_kernel_path(loaded.model)
        logits = [window_logits(loaded.model, loaded.arch, w) for w in windows]
        stats = compare(reference, logits, windows)
        report = loaded.model.weight_report()
        read_mb = sum(n for kind, (_, n) in report.items() if kind != "embed_tokens") / 1e6
        results.append(QualityResult(method, str(torch_dtype).removeprefix("torch."), stats["num_predictions"],
                                     stats["perplexity"], stats["perplexity_change_pct"], stats["top1_agreement"],
                                     stats["mean_kl"], read_mb))
        del loaded
    del ref_model
    return results
