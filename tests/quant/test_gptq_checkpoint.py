"""`loom quantize --method rtn|gptq`: GPTQ-format checkpoints written, read back by loom's GPTQ loader, run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from loom.quant.layout import Q4_LAYOUTS
from loom.model.loader import load_model
from loom.quant.gptq_checkpoint import GPTQSettings, write_gptq_checkpoint
from loom.quant.gptq_format import from_checkpoint
from loom.quant.gptq_method import GPTQLinearMethod
from tests.model.model_harness import hf_logits
from tests.quant.checkpoint_harness import kl as _kl
from tests.quant.checkpoint_harness import logits as _logits
from tests.quant.checkpoint_harness import windows as _windows

CPU = torch.device("cpu")


@pytest.mark.parametrize(("name", "settings"), [
    ("llama_gqa", GPTQSettings("gptq", 4, 32, True, True)),
    ("llama_gqa", GPTQSettings("gptq", 4, 32, False, True, static_groups=True)),
    ("qwen2_gqa", GPTQSettings("gptq", 8, -1, False, False)),
    ("llama_mha_tied", GPTQSettings("rtn", 4, 32, False, False)),
])
def test_checkpoint_follows_the_format_and_runs_packed(tiny_models, tmp_path, name: str,
                                                       settings: GPTQSettings) -> None:
    tiny = tiny_models[name]
    out = tmp_path / "q"
    vocab = tiny.hf.config.vocab_size
    result = write_gptq_checkpoint(str(tiny.path), str(out), settings, _windows(vocab), calibration="random ids")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": settings.bits, "group_size": settings.group_size,
        "desc_act": settings.desc_act, "sym": settings.sym, "checkpoint_format": "gptq"}
    assert qc["damp_percent"] == 0.01 and qc["true_sequential"] is True
    assert qc["static_groups"] is settings.static_groups
    from transformers import GPTQConfig  # transformers' own reading of the config

    hf = GPTQConfig.from_dict(qc)
    assert (hf.bits, hf.group_size, hf.desc_act, hf.sym, hf.format) == (
        settings.bits, settings.group_size, settings.desc_act, settings.sym, "gptq")
    assert result.calibration_tokens == (4 * 48 if settings.method == "gptq" else 0)
    h, inter = tiny.hf.config.hidden_size, tiny.hf.config.intermediate_size
    groups = 1 if settings.group_size == -1 else h // settings.group_size
    per = 32 // settings.bits
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert not any(n.endswith("_proj.weight") for n in names)  # every projection quantized
        assert "model.embed_tokens.weight" in names and f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
        prefix = "model.layers.1.mlp.up_proj"
        t = {k: f.get_tensor(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (h // per, inter)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (groups, inter // per)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (groups, inter)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (h,)
    if settings.sym:
        zero = 2 ** (settings.bits - 1) - 1  # v1 stores zero - 1
        assert bool((t["qzeros"] == sum(zero << (j * settings.bits) for j in range(per))).all())
    if settings.desc_act and not settings.static_groups:
        assert bool((t["g_idx"][1:] < t["g_idx"][:-1]).any())  # a real act-order permutation
    else:  # static groups keep the plain group order: no permutation at run time
        size = h if settings.group_size == -1 else settings.group_size
        assert torch.equal(t["g_idx"].long(), torch.arange(h) // size)
    from_checkpoint(t, settings.bits)  # decodes

    loaded = load_model(str(out), torch.float32, CPU)  # quantization "gptq" by default
    layer = loaded.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(lin.quant_method, GPTQLinearMethod)
        assert lin.dense_weight is None and (lin.packed[0].layout in Q4_LAYOUTS if settings.bits == 4 else lin.packed[0].layout in ("q8g", "q8gr16"))
    assert (layer.self_attn.qkv_proj.input_perm is not None) == (settings.desc_act and not settings.static_groups)
    # the unquantized head (GPTQ's default) reads its float32 matrix with loom's GEMV at decode rows
    from loom.kernels.registry import get_kernel
    from loom.model.layers.linear import Float32GemvLinearMethod, UnquantizedLinearMethod

    head_method = Float32GemvLinearMethod if get_kernel("gemv_f32") is not None else UnquantizedLinearMethod
    assert type(loaded.model.lm_head.quant_method) is head_method
    fmt, _ = loaded.model.weight_report()["qkv_proj"]
    assert "gptq" in fmt and f"GPTQ {settings.bits}-bit" in fmt

    tokens = _windows(vocab, 1, 32, seed=9)[0]
    reference = hf_logits(tiny.hf, tokens)
    ours = _logits(loaded, tokens)
    assert _kl(reference, ours) < (0.2 if settings.bits == 4 else 0.01)  # random weights: no outliers to spare
    # the packed model computes what the quantized weights say (the dense model they were written from)
    dense = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    assert type(dense.model.lm_head.quant_method) is UnquantizedLinearMethod  # the oracle keeps torch's F.linear
    from loom.quant.gptq_checkpoint import quantize_model_weights

    quantize_model_weights(dense.model, dense.arch, settings, _windows(vocab))
    # (asymmetric 4-bit: the float16 min = -zero * scale is within 2^-11 of the file's; gptq_format.py)
    torch.testing.assert_close(ours, _logits(dense, tokens), rtol=1e-3,
                               atol=5e-3 if settings.sym or settings.bits == 8 else 2e-2)


def test_gptq_beats_rtn_and_runs_through_llm(tiny_models, tmp_path) -> None:
    from loom import LLM, SamplingParams

    import shutil

    from loom.model.loader import load_tokenizer

    tiny = tiny_models["llama_gqa"]
    vocab = tiny.hf.config.vocab_size
    source = tmp_path / "src"  # the tiny model with a tokenizer, for the engine (its ids cover the tiny vocab)
    shutil.copytree(tiny.path, source)
    load_tokenizer(None).save_pretrained(str(source))
    calib = _windows(vocab, 6, 64, seed=1)
    outs = {}
    for method in ("rtn", "gptq"):
        outs[method] = tmp_path / method
        write_gptq_checkpoint(str(source), str(outs[method]), GPTQSettings(method, 4, 32, False, False), calib)
    held_out = _windows(vocab, 3, 48, seed=2)
    kl = {m: sum(_kl(hf_logits(tiny.hf, w), _logits(load_model(str(p), torch.float32, CPU), w)) for w in held_out)
          for m, p in outs.items()}
    assert kl["gptq"] < kl["rtn"]

    prompts = [w[:12] for w in held_out]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy(path) -> list[list[int]]:
        kwargs = {"quantization": "none"} if path == source else {}
        llm = LLM(model=str(path), dtype="float32", **kwargs)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = greedy(source)
    outs["gptq8"] = tmp_path / "gptq8"
    write_gptq_checkpoint(str(source), str(outs["gptq8"]), GPTQSettings("gptq", 8, 32, False, True), calib)
    assert greedy(outs["gptq8"]) == ref  # 8 bits with act-order (an input permutation): the float model's tokens
    # 4 bits: random O(1) weights leave no redundancy, and greedy paths part after a token or two; the
    # teacher-forced KL above is the measure.
    got = greedy(outs["gptq"])
    assert sum(r[0] == g[0] for r, g in zip(ref, got, strict=True)) >= 2


def test_other_quantization_of_a_gptq_checkpoint_is_refused(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    out = tmp_path / "q"
    write_gptq_checkpoint(str(tiny.path), str(out), GPTQSettings("rtn", 8, 32, True, False), [])
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(out), torch.float32, CPU, quantization="w4a16")
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        load_model(str(tiny.path), torch.float32, CPU, quantization="gptq")
    # `loom bench quality` on the checkpoint alone: it cannot be its own float32 reference, and the error says which
    # flag to pass (it named quantization 'none', which the user never passed: fresh-user trial)
    from loom.bench.quality import run_quality

    with pytest.raises(ValueError, match="cannot be its own float32 reference; pass its source as --reference-model"):
        run_quality(str(out), ["gptq"], "float32", [[1, 2, 3]])
    with pytest.raises(ValueError, match="desc_act"):
        write_gptq_checkpoint(str(tiny.path), str(tmp_path / "x"), GPTQSettings("rtn", 4, 32, True, True), [])
    with pytest.raises(ValueError, match="group_size"):
        GPTQSettings("gptq", 4, 48, True, False).check()
    with pytest.raises(ValueError, match="static_groups applies with desc_act"):
        GPTQSettings("gptq", 4, 32, True, False, static_groups=True).check()


def test_gptq_v2_checkpoint_loads_the_same(tiny_models, tmp_path) -> None:
    """checkpoint_format gptq_v2 stores the zero points themselves (v1: zero - 1)."""
    from safetensors.torch import save_file

    from loom.quant.gptq_format import pack_int32, unpack_int32

    tiny = tiny_models["llama_gqa"]
    v1 = tmp_path / "v1"
    write_gptq_checkpoint(str(tiny.path), str(v1), GPTQSettings("rtn", 4, 32, False, False), [])
    v2 = tmp_path / "v2"
    v2.mkdir()
    with safe_open(str(v1 / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, t in tensors.items():
        if k.endswith(".qzeros"):
            tensors[k] = pack_int32(unpack_int32(t, 4, 1) + 1, 4, 1)
    save_file(tensors, str(v2 / "model.safetensors"))
    config = json.loads((v1 / "config.json").read_text())
    del config["quantization_config"]["checkpoint_format"]
    config["quantization_config"]["format"] = "gptq_v2"
    (v2 / "config.json").write_text(json.dumps(config))
    tokens = _windows(tiny.hf.config.vocab_size, 1, 24, seed=3)[0]
    a, b = (_logits(load_model(str(p), torch.float32, CPU), tokens) for p in (v1, v2))
    assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("model", [None, "/some/where/model.Q4_K_M.GGUF"])
def test_a_checkpoint_method_on_a_gguf_file_is_refused_before_loading(method: str, model: str | None) -> None:
    # refused only after the GGUF was read (~7 s) before (fresh-user trial); the bundled model is a GGUF file
    from loom.config import EngineArgs, ModelConfig

    with pytest.raises(ValueError, match=f"quantization='{method}' needs an? {method.upper()} checkpoint.*GGUF file"):
        ModelConfig(model=model, quantization=method)
    with pytest.raises(ValueError, match="GGUF file"):
        EngineArgs(model=model, quantization=method).model_config()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_early_refusal_follows_the_loader_not_the_file_name(method: str, tmp_path) -> None:
    """A GGUF file is one whatever its name, a directory a Hugging Face checkpoint even if named like a GGUF
    file: the early refusal goes by the file's magic, not its suffix; a file that is no GGUF is left to the
    loader, which says so (fresh-user trial: a text file was called a GGUF file)."""
    from loom.config import ModelConfig
    from loom.model.loader import load_model

    renamed = tmp_path / "smollm2.bin"
    renamed.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="GGUF file"):
        ModelConfig(model=str(renamed), quantization=method)
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert ModelConfig(model=str(text), quantization=method).quantization == method
    with pytest.raises(ValueError, match="not a GGUF file: it does not start with the magic bytes"):
        load_model(str(text), torch.float32, CPU, quantization=method)
    folder = tmp_path / "checkpoint.gguf"
    folder.mkdir()
    assert ModelConfig(model=str(folder), quantization=method).quantization == method


@pytest.mark.parametrize(("tied", "head_bits", "base_bits"), [(True, 8, 4), (False, 8, 8), (False, 4, 4)])
def test_the_lm_head_quantized_too_loads_untied_and_runs_packed(tmp_path, tied: bool, head_bits: int,
                                                                base_bits: int) -> None:
    """lm_head_bits: the head (a tied embedding's matrix) written as GPTQ tensors, GPTQModel's `lm_head: true`, its
    bits in a `dynamic` rule when they differ from the base; the embedding stays float and the config untied; loom
    runs the head packed, computing what RTN's values say."""
    from transformers import LlamaConfig

    from loom.quant.gptq import rtn_quantize
    from tests.model.model_harness import save_tiny_model

    hf = save_tiny_model(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     tie_word_embeddings=tied), tmp_path / "src", seed=5)
    out = tmp_path / "q"
    settings = GPTQSettings("rtn", base_bits, 32, True, False, lm_head_bits=head_bits)
    write_gptq_checkpoint(str(tmp_path / "src"), str(out), settings, [])
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["lm_head"] is True and config["tie_word_embeddings"] is False
    assert qc.get("dynamic") == ({"+:lm_head": {"bits": head_bits}} if head_bits != base_bits else None)
    vocab, h = hf.config.vocab_size, hf.config.hidden_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embedding = f.get_tensor("model.embed_tokens.weight")
        head = {k: f.get_tensor(f"lm_head.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
    assert "lm_head.weight" not in names and embedding.dtype == torch.float32
    assert head["qweight"].shape == (h * head_bits // 32, vocab)
    source = hf.get_output_embeddings().weight.detach().float()
    expected = rtn_quantize(source, head_bits, 32, True).dequantize()
    torch.testing.assert_close(from_checkpoint(head, head_bits).dequantize(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(embedding, hf.get_input_embeddings().weight.detach().float(), rtol=0, atol=0)

    loaded = load_model(str(out), torch.float32, CPU)
    lm_head = loaded.model.lm_head
    assert isinstance(lm_head.quant_method, GPTQLinearMethod) and lm_head.quant_method.bits == head_bits
    assert lm_head.packed and (lm_head.packed[0].layout in Q4_LAYOUTS if head_bits == 4 else lm_head.packed[0].layout in ("q8g", "q8gr16"))
    assert "GPTQ" in loaded.model.weight_report()["lm_head"][0]
    hidden = torch.randn(3, h, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded.model.compute_logits(hidden), hidden @ expected.T, rtol=1e-3, atol=2e-3)


def test_lm_head_bits_are_checked(tiny_models, tmp_path) -> None:
    with pytest.raises(ValueError, match="lm_head_bits must be 4 or 8, got 3"):
        GPTQSettings("rtn", 4, 32, True, False, lm_head_bits=3).check()
    with pytest.raises(ValueError, match="lm_head_bits: a vocabulary of 97 tokens does not pack"):  # GPTQ packs N too
        write_gptq_checkpoint(str(tiny_models["llama_gqa"].path), str(tmp_path / "q"),
                              GPTQSettings("rtn", 4, 32, True, False, lm_head_bits=8), [])
