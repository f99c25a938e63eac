"""`loom quantize`'s checkpoints read by the reference implementations' own code: GPTQ by AutoGPTQ's QuantLinear,
AWQ by AutoAWQ's dequantize_gemm (tests/quant/reference_impl.py; those skip, saying why, when pip cannot fetch
them), FP8
and W8A8 (compressed-tensors) by transformers with the compressed-tensors library. Every quantized layer decodes
to the weights loom's loader reads, and a transformers model built from the reference's weights gives the logits
loom's packed kernels give."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from loom.model.loader import load_model
from loom.quant import awq_format, gptq_format
from loom.quant.awq_checkpoint import write_awq_checkpoint
from loom.quant.awq_model import AWQSettings
from loom.quant.gptq_checkpoint import GPTQSettings, write_gptq_checkpoint
from tests.model.model_harness import hf_logits
from tests.quant.checkpoint_harness import kl as _kl
from tests.quant.checkpoint_harness import logits as _logits
from tests.quant.checkpoint_harness import windows as _windows
from tests.quant.reference_impl import reference_module

CPU = torch.device("cpu")


def _module(name: str):
    try:
        return reference_module(name)
    except RuntimeError as e:  # no network / no index: a missing resource, not a loom failure
        pytest.skip(f"reference implementation unavailable: {e}")


def _tensors(out) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _quantized_prefixes(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))


def _reference_model(out, tensors: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor]):
    """The checkpoint as a transformers model: its float tensors as written, each quantized layer's weight [N, K]
    from the reference's decoding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(out))
    del config.quantization_config  # the dense model the reference's weights describe
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v.float() for k, v in tensors.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    state.update({f"{p}.weight": w.float() for p, w in dequantized.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" and config.tie_word_embeddings for k in missing), (
        missing, unexpected)
    return model


def _loom_logits(out, tokens: list[int]) -> torch.Tensor:
    return _logits(load_model(str(out), torch.float32, CPU), tokens)


@pytest.mark.parametrize(("name", "settings"), [
    ("llama_gqa", GPTQSettings("gptq", 4, 32, sym=True, desc_act=False)),
    ("llama_gqa", GPTQSettings("gptq", 4, 32, sym=False, desc_act=True)),  # a real act-order permutation in g_idx
    ("qwen2_gqa", GPTQSettings("gptq", 8, -1, sym=False, desc_act=False)),  # biases; one group per channel
    ("llama_mha_tied", GPTQSettings("rtn", 4, 32, sym=False, desc_act=False)),  # a tied head, kept dense
    # mixed precision: 4-bit and 8-bit layers in one file (quantization_config.dynamic)
    ("llama_gqa", GPTQSettings("rtn", 4, 64, sym=False, desc_act=False, target_bits=6.5)),
])
def test_autogptq_reads_loom_gptq_checkpoints(tiny_models, tmp_path, name: str, settings: GPTQSettings) -> None:
    ref = _module("auto_gptq_qlinear_cuda")
    tiny = tiny_models[name]
    out = tmp_path / "q"
    write_gptq_checkpoint(str(tiny.path), str(out), settings, _windows(tiny.hf.config.vocab_size))
    tensors = _tensors(out)
    prefixes = _quantized_prefixes(tensors)
    assert len(prefixes) == 7 * tiny.hf.config.num_hidden_layers  # q, k, v, o, gate, up, down of every layer
    dequantized, bits_seen = {}, set()
    for p in prefixes:
        t = {k: tensors[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        k_in, n_out = t["g_idx"].numel(), t["scales"].shape[1]
        bits = t["qweight"].shape[0] * 32 // k_in  # per layer: mixed-precision files differ by layer
        groups = t["scales"].shape[0]
        # weight_dtype float32 (a constructor option): the file's float16 scales widened exactly, so each weight
        # is scale * (code - zero) rounded once, as loom computes it, rather than rounded again to float16
        layer = ref.QuantLinear(bits, -1 if groups == 1 else math.ceil(k_in / groups), k_in, n_out, bias=False,
                                weight_dtype=torch.float32)
        layer.load_state_dict(t)  # shapes as AutoGPTQ allocates them
        assert not layer.autogptq_cuda_available  # its plain-torch path, the one a CPU runs
        with torch.no_grad():  # identity rows: out = W^T exactly (one nonzero product per sum)
            w_ref = layer(torch.eye(k_in)).T  # [N, K]
        ours = gptq_format.from_checkpoint(t, bits)  # loom's reading of the same tensors
        assert torch.equal(w_ref, ours.dequantize())
        # ... and AutoGPTQ's own writer (QuantLinear.pack), given these weights, scales, zero points and g_idx,
        # writes loom's bytes: loom's reader is tested on the reference's files too
        packer = ref.QuantLinear(bits, layer.group_size, k_in, n_out, bias=False, weight_dtype=torch.float32)
        linear = torch.nn.Linear(k_in, n_out, bias=False)
        linear.weight.data = w_ref
        packer.pack(linear, ours.scales.float().T, ours.zeros.T.contiguous(), g_idx=ours.g_idx)
        for key in ("qweight", "qzeros", "g_idx"):
            assert torch.equal(getattr(packer, key).to(torch.int32), t[key]), (p, key)
        assert torch.equal(packer.scales.half(), t["scales"])
        dequantized[p] = w_ref
        bits_seen.add(bits)
    if settings.target_bits is not None:
        assert bits_seen == {4, 8}
    tokens = _windows(tiny.hf.config.vocab_size, 1, 32, seed=9)[0]
    reference = hf_logits(_reference_model(out, tensors, dequantized), tokens)
    # loom holds an asymmetric 4-bit layer's zero as a float16 min = -zero * scale (gptq_format.py)
    tol = 5e-3 if settings.sym or settings.bits == 8 else 2e-2
    torch.testing.assert_close(_loom_logits(out, tokens), reference, rtol=1e-3, atol=tol)


@pytest.mark.parametrize("name", ["llama_mha_tied", "qwen2_gqa"])
def test_autoawq_reads_loom_awq_checkpoints(tiny_models, tmp_path, name: str) -> None:
    ref = _module("autoawq_packing_utils")
    tiny = tiny_models[name]
    out = tmp_path / "q"
    vocab = tiny.hf.config.vocab_size
    settings = AWQSettings(group_size=32)
    write_awq_checkpoint(str(tiny.path), str(out), settings, _windows(vocab))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["version"], qc["bits"], qc["group_size"], qc["zero_point"]) == (
        "awq", "gemm", 4, 32, True)
    tensors = _tensors(out)
    dequantized = {}
    for p in _quantized_prefixes(tensors):
        t = {k: tensors[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales")}
        # float32 scales (the file's float16 widened exactly): each weight rounded once, as loom computes it
        w_ref = ref.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), 4, 32).T  # [N, K]
        assert torch.equal(w_ref, awq_format.from_checkpoint(t, 32).dequantize())  # loom's reading
        dequantized[p] = w_ref
    tokens = _windows(vocab, 1, 32, seed=9)[0]
    reference = hf_logits(_reference_model(out, tensors, dequantized), tokens)
    torch.testing.assert_close(_loom_logits(out, tokens), reference, rtol=1e-3, atol=2e-2)


@pytest.mark.parametrize("method", ["fp8", "w8a8", "w8a8-static"])
def test_transformers_reads_loom_compressed_tensors_checkpoints(tiny_models, tmp_path, method: str) -> None:
    """transformers with the compressed-tensors library (vLLM's and llm-compressor's reader of the format) loads
    loom's FP8 and W8A8 files and dequantizes them (`CompressedTensorsConfig(dequantize=True)`): every layer's
    weight is exactly the file's codes times its scales, and its dense model gives loom's logits (fp8; w8a8 runs
    int8 activations per token, so within a KL bound)."""
    pytest.importorskip("compressed_tensors")  # a test extra (pyproject.toml)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from loom.quant.fp8_checkpoint import write_fp8_checkpoint
    from loom.quant.int8_checkpoint import write_int8_checkpoint

    tiny = tiny_models["qwen2_gqa"]
    out = tmp_path / method
    vocab = tiny.hf.config.vocab_size
    if method == "fp8":
        write_fp8_checkpoint(str(tiny.path), str(out))
    else:
        activations = "static" if method == "w8a8-static" else "dynamic"  # static: an input_scale per layer
        write_int8_checkpoint(str(tiny.path), str(out), _windows(vocab), activations=activations)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    tensors = _tensors(out)
    scaled = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    assert len(scaled) == 7 * tiny.hf.config.num_hidden_layers
    for p in scaled:
        w = reference.get_submodule(p).weight
        assert w.dtype == torch.float32
        assert torch.equal(w, tensors[f"{p}.weight"].float() * tensors[f"{p}.weight_scale"].float()), p
    tokens = _windows(vocab, 1, 32, seed=9)[0]
    if method == "fp8":  # the engine's float16 KV cache under packed CPU weights would add its own rounding
        ours = _logits(load_model(str(out), torch.float32, CPU), tokens, kv_cache_dtype="float32")
    else:
        ours = _loom_logits(out, tokens)
    theirs = hf_logits(reference, tokens)
    if method == "fp8":
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    else:
        assert _kl(theirs, ours) < 0.01  # measured 0.0005 dynamic, 0.0024 static
