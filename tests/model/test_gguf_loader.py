"""GGUF loading: name mapping and llama.cpp's Q/K row permutation on synthetic files written with
gguf.GGUFWriter from tiny HF models, plus the real bundled SmolLM2 against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.model.loader import load_model
from loom.model.loader.hf_config import hf_arch_config
from loom.model.loader.gguf import gguf_tensor_name, unpermute_rope_rows
from tests.model.model_harness import PagedHarness, TinyModel, hf_logits

CPU = torch.device("cpu")

# HF module path under model.layers.{i} -> GGUF stem (the inverse of the loader's table, written out
# independently here so a typo on either side shows up).
_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The reordering llama.cpp's HF->GGUF converter applies to llama Q/K rows."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    if not hf_name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[hf_name]  # fmt: skip
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{suffix}"


# the mixture-of-experts and post-norm names, again written out independently of the loader
_TO_GGUF_FAMILY = {
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}  # fmt: skip


def _converted(tiny: TinyModel, gguf_arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> array of a tiny HF model, laid out as llama.cpp's converter writes it: llama-arch Q/K rows
    permuted, each expert projection stacked into one [experts, rows, columns] tensor, Phi-3's fused projections
    kept fused, Qwen2-MoE's shared-expert gate as a vector, OLMo 2's post-attention norm under its own name."""
    cfg = tiny.hf.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in tiny.hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy().copy()
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5: [experts, 2 * width, hidden], gate first
            layer = name.split(".")[2]
            width = array.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(array[:, :width])
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(array[:, width:])
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = array
            continue
        if gguf_arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif gguf_arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)
        if not name.startswith("model.layers."):
            out[_gguf_name(name)] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        stem = _TO_GGUF_FAMILY.get(module) or _TO_GGUF[module]
        if gguf_arch == "olmo2" and module == "post_attention_layernorm":
            stem = "post_attention_norm"
        out[f"blk.{layer}.{stem}.{suffix}"] = array
    return out


def write_gguf(tiny: TinyModel, path: Path, gguf_arch: str, quantize: bool = False,
               longrope: dict | None = None) -> None:
    """Write `tiny` as llama.cpp's converter would. quantize: Q8_0 for every weight matrix whose rows are whole
    blocks of 32 (others, the norms and the routers stay F32, as llama-quantize leaves them); longrope: Phi-3's
    {"long_factor", "short_factor", "original_max_position_embeddings"} as the converter stores them (two
    tensors, the original context length and the precomputed cos/sin scale)."""
    import gguf

    cfg = tiny.hf.config
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(3)
    writer.add_eot_token_id(4)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if gguf_arch == "phi3":
        writer.add_sliding_window(cfg.sliding_window or 0)
    tensors = _converted(tiny, gguf_arch)
    if longrope is not None:
        original = longrope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        tensors["rope_factors_long.weight"] = np.array(longrope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(longrope["short_factor"], dtype=np.float32)
    for name, array in tensors.items():
        if quantize and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unpermute_inverts_the_converter_permutation() -> None:
    weight = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(6 * 4, 3)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 6))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rope_rows(permuted, 6), weight)
    bias = torch.arange(8.0)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias)


def test_tensor_name_mapping() -> None:
    assert gguf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert gguf_tensor_name("output.weight") == "lm_head.weight"
    assert gguf_tensor_name("blk.0.mystery.weight") is None


_GGUF_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


@pytest.mark.parametrize(
    "name,gguf_arch", [("llama_gqa", "llama"), ("llama_mha_tied", "llama"), ("qwen2_gqa", "qwen2"),
                       ("qwen3_qknorm", "qwen3"), ("olmo2_postnorm", "olmo2"), ("phi3_fused", "phi3"),
                       ("mixtral_moe", "llama"), ("qwen2moe_shared", "qwen2moe"), ("qwen3moe_qknorm", "qwen3moe"),
                       ("olmoe", "olmoe")]
)
def test_synthetic_gguf_matches_hf(
    name: str, gguf_arch: str, tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    tiny = tiny_models[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(tiny, path, gguf_arch)
    loaded = load_model(str(path), torch.float32, CPU, quantization="none")
    # the file's arch equals the one the HF config gives (Mixtral: a llama file with experts)
    hf_arch = hf_arch_config(json.loads((tiny.path / "config.json").read_text()))
    expected = "MixtralForCausalLM" if name == "mixtral_moe" else _GGUF_FAMILIES[gguf_arch]
    assert loaded.arch.architecture == hf_arch.architecture == expected
    for field in ("tie_word_embeddings", "attention_bias", "qk_norm", "post_norm", "sliding_window", "num_experts",
                  "num_experts_per_tok", "moe_renormalize", "shared_expert_intermediate_size", "dense_mlp_layers"):
        assert getattr(loaded.arch, field) == getattr(hf_arch, field), field
    assert loaded.eos_token_ids == frozenset({3, 4}) and loaded.tokenizer is None
    harness = PagedHarness(loaded.model, loaded.arch, block_size=4)
    prompts = {0: [5, 17, 33, 2, 8, 60, 41], 1: [9, 90, 11]}
    out = harness.step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(out[i], hf_logits(tiny.hf, prompt), atol=1e-4, rtol=0)


def _write_minimal_gguf(path: Path, gguf_arch: str, width: int, fields: dict[str, int] | None = None) -> Path:
    """A GGUF file of `gguf_arch` with uint32 metadata `fields` ({arch}.key) and a zero embedding [4, width]."""
    import gguf

    writer = gguf.GGUFWriter(str(path), gguf_arch)
    for key, value in (fields or {}).items():
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, width), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = _write_minimal_gguf(tmp_path / "gpt2.gguf", "gpt2", 4)
    with pytest.raises(ValueError, match="'gpt2'.*llama.*qwen2"):
        load_model(str(path), torch.float32, CPU, quantization="none")


def test_files_that_are_not_gguf_are_named_as_such(tmp_path: Path) -> None:
    """Each kind of bad file gets its own sentence naming it, not numpy's words about array sizes."""
    from loom.model.loader.gguf import open_gguf

    good = _write_minimal_gguf(tmp_path / "good.gguf", "llama", 4).read_bytes()
    cases = {
        "text.gguf": (b"not a model at all", "not a GGUF file: it does not start with the magic bytes 'GGUF'"),
        "empty.gguf": (b"", "not a GGUF file"),
        "v99.gguf": (b"GGUF" + (99).to_bytes(4, "little") + good[8:], "GGUF file of version 99, which cannot be read"),
        "short.gguf": (b"GGUF\x03", "truncated GGUF file"),
        "cut.gguf": (good[: len(good) // 3], "not a readable GGUF file \\(truncated or damaged"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"'{tmp_path / name}'.*{message}"):
            open_gguf(tmp_path / name)
    assert open_gguf(tmp_path / "good.gguf").tensors


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "<|im_start|>user\nHi!<|im_end|>\n"]


@pytest.fixture(scope="session")
def loom_smollm2():  # noqa: ANN201 (LoadedModel)
    return load_model(None, torch.float32, CPU, quantization="none")


@pytest.mark.slow
def test_bundled_smollm2_matches_transformers(loom_smollm2, hf_gguf_model) -> None:  # noqa: ANN001
    tok = loom_smollm2.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    harness = PagedHarness(loom_smollm2.model, loom_smollm2.arch, block_size=4, num_blocks=32)
    out = harness.step(dict(enumerate(prompts)))
    nxt = {i: [int(out[i][-1].argmax())] for i in out}
    decoded = harness.step(nxt)
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf_gguf_model, prompt + nxt[i])
        torch.testing.assert_close(out[i], ref[:-1], atol=1e-3, rtol=0)
        torch.testing.assert_close(decoded[i][-1], ref[-1], atol=1e-3, rtol=0)
        assert torch.equal(out[i].argmax(-1), ref[:-1].argmax(-1))


@pytest.mark.slow
def test_bundled_smollm2_arch_tokenizer_and_eos(loom_smollm2) -> None:  # noqa: ANN001
    arch = loom_smollm2.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings and arch.head_dim == 64
    assert 2 in loom_smollm2.eos_token_ids  # <|im_end|>
    tok = loom_smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_gemma3_270m_gguf_arch_and_names(gemma3_reader) -> None:  # noqa: ANN001
    """The real Gemma-3-270M file: llama.cpp's fixed layer pattern (every 6th layer global) and local rotary base,
    its sandwich-norm tensor names, and norm weights read back without the 1 the converter added."""
    from loom.model.loader.gguf import gguf_arch_config, gguf_tensor_name, iter_gguf_weights

    reader = gemma3_reader  # open_gguf(the file), parsed once for the session
    arch = gguf_arch_config(reader)
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.num_layers, arch.hidden_size, arch.head_dim) == (18, 640, 256)
    assert [i for i in range(18) if arch.layer_sliding_window(i) is None] == [5, 11, 17]
    assert arch.sliding_window == 512 and arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4
    assert arch.tie_word_embeddings and arch.vocab_size == 262144 and arch.attention_scale == 256**-0.5
    assert gguf_tensor_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert gguf_tensor_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_tensor_name("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_q_norm.weight"]
    q_norm = next(w for name, w in iter_gguf_weights(reader, arch, keep_packed=True)
                  if name == "model.layers.0.self_attn.q_norm.weight")
    assert torch.equal(q_norm + 1.0, torch.from_numpy(raw.data.copy()))


@pytest.mark.parametrize("name,gguf_arch", [("phi3_fused", "phi3"), ("mixtral_moe", "llama"),
                                            ("qwen2moe_shared", "qwen2moe"), ("olmoe", "olmoe")])
def test_quantized_gguf_parts_stay_packed(
    name: str, gguf_arch: str, tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    """Q8_0 files of the families whose GGUF tensors hold several of ours: each expert's slice of a stacked
    tensor and each part of Phi-3's fused qkv / gate_up is repacked from the file's own blocks (the routers stay
    dense), and the packed model's logits equal those of the same file dequantized."""
    tiny = tiny_models[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(tiny, path, gguf_arch, quantize=True)
    packed = load_model(str(path), torch.float32, CPU)  # the default for a GGUF file: its own blocks
    dense = load_model(str(path), torch.float32, CPU, quantization="none")
    report = packed.model.weight_report()
    assert report["qkv_proj"][0] == report["gate_up_proj"][0] in ("gguf q8g/32 (GGUF Q8_0)",
                                                                 "gguf q8gr16/32 (GGUF Q8_0)"), report  # r16: VNNI
    assert "GGUF" not in dense.model.weight_report()["gate_up_proj"][0]
    if packed.arch.num_experts:
        assert "GGUF" not in report["gate"][0], report  # the router
        moe = packed.model.model.layers[0].mlp
        assert all(e.gate_up_proj.weight_format()[0] == report["qkv_proj"][0] for e in moe.experts)
    prompts = {0: [5, 17, 33, 2, 8, 60, 41], 1: [9, 90, 11]}
    out = PagedHarness(packed.model, packed.arch, block_size=4).step(prompts)
    ref = PagedHarness(dense.model, dense.arch, block_size=4).step(prompts)
    for i in prompts:
        torch.testing.assert_close(out[i], ref[i], atol=2e-3, rtol=0)


def test_phi3_longrope_gguf_matches_hf(tmp_path: Path) -> None:
    """Phi-3's LongRoPE as llama.cpp stores it (rope_factors_long / rope_factors_short tensors, the original
    context length and the precomputed cos/sin scale in metadata): a 7-token prompt past the original 4
    positions rotates with the long factors, a 3-token one with the short, both equal to transformers."""
    from transformers import Phi3Config

    from tests.model.conftest import _COMMON
    from tests.model.model_harness import save_tiny_model

    head_dim = _COMMON["hidden_size"] // _COMMON["num_attention_heads"]
    longrope = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
                "long_factor": [1.5 + 0.8 * i for i in range(head_dim // 2)]}
    config = Phi3Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                        rope_scaling=longrope, original_max_position_embeddings=4)
    tiny = TinyModel("phi3_longrope", tmp_path / "hf", save_tiny_model(config, tmp_path / "hf", seed=7))
    path = tmp_path / "phi3_longrope.gguf"
    write_gguf(tiny, path, "phi3", longrope={**longrope, "original_max_position_embeddings": 4})
    loaded = load_model(str(path), torch.float32, CPU, quantization="none")
    scaling = loaded.arch.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4
    assert loaded.model.model.rotary_emb.long_from == 4
    prompts = {0: [5, 17, 33, 2, 8, 60, 41], 1: [9, 90, 11]}
    out = PagedHarness(loaded.model, loaded.arch, block_size=4).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(out[i], hf_logits(tiny.hf, prompt), atol=1e-4, rtol=0)


def test_partial_rotary_gguf_is_refused(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    path = _write_minimal_gguf(tmp_path / "partial.gguf", "phi3", 64, {
        "block_count": 1, "embedding_length": 64, "attention.head_count": 4, "rope.dimension_count": 12})
    with pytest.raises(ValueError, match="rope.dimension_count 12 != head_dim 16"):
        load_model(str(path), torch.float32, CPU, quantization="none")
