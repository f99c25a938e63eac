"""KV cache quantization: row format, error bounds, writes over several steps, bytes per token."""

from __future__ import annotations

import pytest
import torch

from loom.attention.backend import gather_kv, write_kv_cache
from loom.attention.kv_quant import (
    INT8_GROUP_SIZE,
    dequantize_rows,
    kv_head_dim,
    kv_row_width,
    quantize_rows,
    resolve_kv_cache_dtype,
)
from loom.model.arch import ModelArchConfig
from loom.worker.kv_cache import allocate_kv_caches, kv_cache_bytes_per_token
from loom.worker.kv_offload import HostKVCache

QUANT = [torch.int8, torch.float8_e4m3fn]
# Worst-case error per element / row absmax: int8 steps are (group max - min) / 255 <= 2 absmax / 255, half a
# step of rounding error, plus what storing the minimum and the step as float16 moves (2^-11 of |min| <= absmax,
# and up to 255 steps of 2^-11 of a step, <= 2 absmax 2^-11, where the rounded range clamps a code; a step below
# float16's normal range rounds to 2^-24, so 255 half-ulps of it, ABS_ERR, come on top); e4m3 keeps 3 mantissa
# bits. (Checked on 6,000 seeded draws; the first form of this bound, 1.01 / 255, failed 1 in ~20.)
REL_ERR = {torch.int8: 1 / 255 + 3 * 2**-11, torch.float8_e4m3fn: 2**-4}
ABS_ERR = {torch.int8: 255 * 2**-25, torch.float8_e4m3fn: 0.0}
ROW_WIDTH = {(torch.int8, 64): 72, (torch.int8, 80): 92, (torch.int8, 16): 20,  # + 4 bytes per group of 32
             (torch.float8_e4m3fn, 64): 68, (torch.float8_e4m3fn, 80): 84, (torch.float8_e4m3fn, 16): 20}


@pytest.mark.parametrize("head_dim", [64, 80, 16])  # 80 and 16: a last int8 group shorter than 32
@pytest.mark.parametrize("kv_dtype", QUANT)
def test_rows_round_trip_within_the_format_error(kv_dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(5, 3, head_dim, generator=gen) * torch.logspace(-3, 2, 5)[:, None, None]  # very different rows
    x[0, 0] = 0.0  # an all-zero row stays finite
    x[1, 1] = 3.0  # so does a constant one
    rows = quantize_rows(x, kv_dtype)
    assert rows.shape == (5, 3, ROW_WIDTH[(kv_dtype, head_dim)]) and rows.dtype == kv_dtype
    assert kv_row_width(head_dim, kv_dtype) == rows.shape[-1]
    back = dequantize_rows(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert back.shape == x.shape and torch.isfinite(back).all()
    assert ((back - x).abs() <= amax * REL_ERR[kv_dtype] + ABS_ERR[kv_dtype] + 1e-6).all()


def test_int8_error_is_bounded_per_group_so_an_outlier_channel_stays_in_its_group() -> None:
    g = INT8_GROUP_SIZE
    x = torch.randn(4, 2, 4 * g) * 0.1 + 0.5  # offset groups: the zero point spends all codes on [min, max]
    x[..., 3] = 40.0  # an outlier channel (as in K of small models) widens only the first group's scale
    back = dequantize_rows(quantize_rows(x, torch.int8), torch.float32)
    groups, err = x.unflatten(-1, (4, g)), (back - x).abs().unflatten(-1, (4, g))
    step = (groups.amax(-1) - groups.amin(-1)) / 255  # [4, 2, 4]
    # half a step, plus float16 rounding of the stored minimum (2**-11 relative)
    assert (err <= step[..., None] * 0.5 * 1.001 + groups.abs().amax(-1, keepdim=True) * 2**-11).all()
    assert err[..., 1:, :].max() < 0.002  # the other groups keep a step of about 0.6 / 255


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
    assert sizes == {"auto": 46080, "bfloat16": 23040, "float16": 23040, "int8": 12960, "fp8_e4m3": 12240}
    assert sizes["int8"] / sizes["bfloat16"] == 0.5625  # 1 byte per value + float16 scale and min per 32 values
    assert sizes["fp8_e4m3"] / sizes["bfloat16"] == 0.53125  # 1 byte per value + a float32 scale per 64
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", torch.float32)


def _arch(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 16) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM", num_layers=num_layers, hidden_size=64, num_heads=num_kv_heads * 2,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=128, vocab_size=97,
        max_position_embeddings=128, rope_theta=1e4, rope_scaling=None, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attention_bias=False, sliding_window=None,
    )  # fmt: skip
