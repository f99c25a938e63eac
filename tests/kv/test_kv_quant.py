"""KV cache quantization: row format, error bounds, writes over several steps, bytes per token."""

from __future__ import annotations

import pytest
import torch

from loom.attention.backend import gather_kv, write_kv_cache
from loom.attention.kv_quant import dequantize_rows, kv_head_dim, quantize_rows, resolve_kv_cache_dtype
from loom.model.arch import ModelArchConfig
from loom.worker.kv_cache import allocate_kv_caches, kv_cache_bytes_per_token
from loom.worker.kv_offload import HostKVCache

QUANT = [torch.int8, torch.float8_e4m3fn]
REL_ERR = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4}  # worst-case error per element / row absmax


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_rows_round_trip_within_the_format_error(kv_dtype: torch.dtype) -> None:
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 2, 5)[:, None, None]  # rows of very different magnitude
    x[0, 0] = 0.0  # an all-zero row stays finite
    rows = quantize_rows(x, kv_dtype)
    assert rows.shape == (5, 3, 68) and rows.dtype == kv_dtype
    back = dequantize_rows(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.isfinite(back).all()
    assert ((back - x).abs() <= amax * REL_ERR[kv_dtype] + 1e-12).all()


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_block_written_over_several_steps_reads_back_like_one_write(kv_dtype: torch.dtype) -> None:
    arch = _arch()
    cache = allocate_kv_caches(arch, num_blocks=4, block_size=4, dtype=kv_dtype, device=torch.device("cpu"))[0]
    assert kv_head_dim(cache) == arch.head_dim
    key, value = torch.randn(7, 2, 16), torch.randn(7, 2, 16) * 10
    table = torch.tensor([2, 0], dtype=torch.int32)
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2])
    for start, end in ((0, 1), (1, 3), (3, 6), (6, 7)):  # partial block writes, one at a time
        write_kv_cache(key[start:end], value[start:end], cache, slots[start:end])
    k, v = gather_kv(cache, table, 7, 4)
    once = torch.zeros_like(cache)
    write_kv_cache(key, value, once, slots)
    assert torch.equal(cache.view(torch.uint8), once.view(torch.uint8))
    assert k.dtype == torch.float32
    assert torch.allclose(k, key, atol=key.abs().max().item() * REL_ERR[kv_dtype] * 2)
    assert torch.allclose(v, value, atol=value.abs().max().item() * REL_ERR[kv_dtype] * 2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_host_copies_carry_values_and_scales_bit_exactly(kv_dtype: torch.dtype) -> None:
    caches = allocate_kv_caches(_arch(), num_blocks=3, block_size=4, dtype=kv_dtype, device=torch.device("cpu"))
    for cache in caches:
        write_kv_cache(torch.randn(12, 2, 16), torch.randn(12, 2, 16), cache, torch.arange(12))
    before = [c.clone() for c in caches]
    host = HostKVCache(caches, num_host_blocks=2)
    host.offload(caches, [(1, 0), (2, 1)])
    for cache in caches:
        cache.zero_()
    host.restore(caches, [(1, 0), (0, 1)])  # block 2's content comes back in block 0, block 1's in block 1
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, 0].view(torch.uint8), old[:, 2].view(torch.uint8))
        assert torch.equal(cache[:, 1].view(torch.uint8), old[:, 1].view(torch.uint8))


def test_bytes_per_token_per_dtype() -> None:
    smollm2 = _arch(num_layers=30, num_kv_heads=3, head_dim=64)
    sizes = {name: kv_cache_bytes_per_token(smollm2, resolve_kv_cache_dtype(name, torch.float32))
             for name in ("auto", "bfloat16", "float16", "int8", "fp8_e4m3")}  # fmt: skip
    assert sizes == {"auto": 46080, "bfloat16": 23040, "float16": 23040, "int8": 12240, "fp8_e4m3": 12240}
    assert 0.5 < sizes["int8"] / sizes["bfloat16"] < 0.54  # half, plus one float32 scale per 64 values
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", torch.float32)


def _arch(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 16) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM", num_layers=num_layers, hidden_size=64, num_heads=num_kv_heads * 2,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=128, vocab_size=97,
        max_position_embeddings=128, rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attention_bias=False, sliding_window=None,
    )  # fmt: skip
