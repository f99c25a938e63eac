"""KV cache sizing and allocation (loom/worker/kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from loom.model.arch import ModelArchConfig
from loom.worker.kv_cache import allocate_kv_caches, kv_cache_bytes_per_token, num_blocks_for_budget

SMOLLM2 = ModelArchConfig(
    architecture="LlamaForCausalLM", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5, rope_scaling=None,
    rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, sliding_window=None,
)  # fmt: skip


def test_bytes_per_token_is_2_layers_kv_heads_head_dim_bytes() -> None:
    assert kv_cache_bytes_per_token(SMOLLM2, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_cache_bytes_per_token(SMOLLM2, torch.bfloat16) == 23040


def test_num_blocks_for_budget_rounds_down_and_rejects_tiny_budgets() -> None:
    per_block = 46080 * 16
    assert num_blocks_for_budget(SMOLLM2, torch.float32, 16, per_block * 10 + per_block - 1) == 10
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        num_blocks_for_budget(SMOLLM2, torch.float32, 16, per_block - 1)
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_for_budget(SMOLLM2, torch.float32, 0, per_block)


def test_allocate_one_zeroed_tensor_per_layer() -> None:
    caches = allocate_kv_caches(SMOLLM2, 5, 4, torch.float16, torch.device("cpu"))
    assert len(caches) == 30
    assert all(c.shape == (2, 5, 4, 3, 64) and c.dtype == torch.float16 for c in caches)
    assert caches[0].abs().sum() == 0
    assert caches[0].data_ptr() != caches[1].data_ptr()
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_caches(SMOLLM2, 0, 4, torch.float16, torch.device("cpu"))
