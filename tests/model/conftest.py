"""Tiny random-weight checkpoints (2 layers) in several shapes, saved once per session."""

from __future__ import annotations

import pytest
from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config, OlmoeConfig, Phi3Config, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

from tests.model.model_harness import VOCAB, TinyModel, save_tiny_model

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5, eos_token_id=3, bos_token_id=1,
)  # fmt: skip

TINY_CONFIGS = {
    "llama_gqa": lambda: LlamaConfig(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500.0),
    "llama_mha_tied": lambda: LlamaConfig(**_COMMON, num_key_value_heads=4, tie_word_embeddings=True),
    "llama_mqa_llama3": lambda: LlamaConfig(
        **_COMMON, num_key_value_heads=1, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "llama_linear_rope": lambda: LlamaConfig(
        **_COMMON, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "qwen2_gqa": lambda: Qwen2Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral_window": lambda: MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=5),
    # QK-norm, and a head_dim that is not hidden_size / num_heads (as Qwen3's 128 with hidden 1024 and 16 heads)
    "qwen3_qknorm": lambda: Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # post-norm layers and QK-norm over the whole q and k projections
    "olmo2_postnorm": lambda: Olmo2Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    # fused qkv_proj / gate_up_proj in the checkpoint, and a sliding window
    # a mixture-of-experts FFN: 4 experts, top 2
    "mixtral_moe": lambda: MixtralConfig(**_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False),
    # a shared expert, no renormalization, and a dense layer among the sparse ones
    "qwen2moe_shared": lambda: Qwen2MoeConfig(**_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3moe_qknorm": lambda: Qwen3MoeConfig(**_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
                                              tie_word_embeddings=False),
    "olmoe": lambda: OlmoeConfig(**_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                 tie_word_embeddings=False),
    "phi3_fused": lambda: Phi3Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=6,
                                     pad_token_id=0),
}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("tiny_models")
    models = {}
    for i, (name, make) in enumerate(TINY_CONFIGS.items()):
        path = root / name
        models[name] = TinyModel(name, path, save_tiny_model(make(), path, seed=100 + i))
    return models


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models[request.param]
