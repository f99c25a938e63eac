"""Hugging Face directory loading: config variants, sharded weights, EOS ids, and user errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loom.model.loader import load_model, load_tokenizer, read_arch
from loom.model.loader.hf_config import hf_arch_config
from loom.model.registry import get_model_class
from tests.model.model_harness import PagedHarness, TinyModel, hf_logits, save_tiny_model

CPU = torch.device("cpu")


def test_arch_config_from_tiny_configs(tiny_models: dict[str, TinyModel]) -> None:
    qwen = read_arch(str(tiny_models["qwen2_gqa"].path))
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.attention_bias and qwen.num_kv_heads == 2
    llama3 = read_arch(str(tiny_models["llama_mqa_llama3"].path))
    assert llama3.num_kv_heads == 1 and llama3.rope_scaling is not None
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_scaling["factor"] == 8.0
    assert read_arch(str(tiny_models["llama_gqa"].path)).rope_theta == 500.0
    assert read_arch(str(tiny_models["llama_mha_tied"].path)).tie_word_embeddings
    assert read_arch(str(tiny_models["mistral_window"].path)).sliding_window == 5


def test_legacy_rope_scaling_keys_and_missing_architectures() -> None:
    config = {
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 96, "vocab_size": 10, "rope_theta": 123.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }  # fmt: skip
    arch = hf_arch_config(config)
    assert arch.architecture == "LlamaForCausalLM" and arch.rope_theta == 123.0
    assert arch.rope_scaling == {"type": "linear", "factor": 4.0, "rope_type": "linear"}
    assert arch.num_kv_heads == 4 and arch.head_dim == 16


def test_sharded_checkpoint_and_generation_config_eos(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    from transformers import LlamaConfig

    src = tiny_models["llama_gqa"]
    config = LlamaConfig.from_pretrained(src.path)
    hf = save_tiny_model(config, tmp_path, seed=7, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    loaded = load_model(str(tmp_path), torch.float32, CPU)
    assert loaded.eos_token_ids == frozenset({3, 5})
    assert loaded.tokenizer is None and load_tokenizer(str(tmp_path)) is None
    prompt = [5, 9, 11, 2, 40]
    out = PagedHarness(loaded.model, loaded.arch, block_size=2).step({0: prompt})[0]
    torch.testing.assert_close(out, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_unknown_architecture_names_it_and_lists_supported(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    shutil.copytree(tiny_models["llama_gqa"].path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(str(tmp_path / "m"), torch.float32, CPU)
    with pytest.raises(ValueError, match="'Foo'"):
        get_model_class("Foo")


def test_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(junk), torch.float32, CPU)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), torch.int64, CPU)


def test_checkpoint_missing_a_tensor_is_refused(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_models["llama_gqa"].path
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(str(tmp_path), torch.float32, CPU)


@pytest.mark.parametrize("keep", [0, 100, "half"], ids=["empty", "header-cut", "data-cut"])
def test_a_damaged_safetensors_file_is_a_value_error_naming_it(tmp_path: Path, tiny_models: dict[str, TinyModel],
                                                              keep: int | str) -> None:
    """A truncated or empty shard raised safetensors' own SafetensorError, a traceback from the CLI."""
    src = tiny_models["llama_gqa"].path
    shutil.copy(src / "config.json", tmp_path / "config.json")
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_unsupported_rope_type_is_refused(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    shutil.copytree(tiny_models["llama_gqa"].path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="yarn"):
        load_model(str(tmp_path / "m"), torch.float32, CPU)


def test_gemma_configs_of_both_transformers_layouts() -> None:
    """Gemma 3 as transformers 5 writes it (layer_types, rope_parameters per layer type) and as transformers 4 /
    the released checkpoints wrote it (sliding_window_pattern, rope_local_base_freq, rope_scaling); Gemma 2's
    alternating pattern and soft-caps; what is refused."""
    common = dict(hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                  vocab_size=262144, num_hidden_layers=12, sliding_window=512, query_pre_attn_scalar=256)
    new = hf_arch_config({**common, "model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 5
                          + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"],
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    old = hf_arch_config({**common, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 6,
                          "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    for arch in (new, old):
        assert arch.architecture == "Gemma3ForCausalLM" and arch.qk_norm == "per_head" and arch.sandwich_norm
        assert [arch.layer_sliding_window(i) for i in (0, 4, 5, 6, 11)] == [512, 512, None, 512, None]
        assert arch.layer_rope_is_local(0) and not arch.layer_rope_is_local(5)
        assert arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4 and arch.rope_scaling["factor"] == 8.0
        assert arch.embedding_scale == pytest.approx(640**0.5) and arch.attention_scale == 256**-0.5
        assert arch.norm_weight_offset == 1.0 and arch.hidden_act == "gelu_pytorch_tanh"
        assert arch.sliding_window_all_layers is None  # the KV manager frees nothing early for a hybrid model
    gemma2 = hf_arch_config({**common, "model_type": "gemma2", "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 144})
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.rope_local_theta is None and gemma2.qk_norm is None and gemma2.attention_scale == 144**-0.5
    assert gemma2.attn_logit_softcapping == 50.0 and gemma2.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match="hidden_activation"):
        hf_arch_config({**common, "model_type": "gemma3_text", "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="sliding-layer rope"):
        hf_arch_config({**common, "model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})
    with pytest.raises(ValueError, match="layer_types"):
        hf_arch_config({**common, "model_type": "gemma3_text", "layer_types": ["full_attention"] * 3})
