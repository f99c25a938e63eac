"""Reference paged attention against dense causal attention computed directly from the inputs."""

from __future__ import annotations

import math

import pytest
import torch

from loom.attention import (
    PAD_SLOT_ID,
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
    write_kv_cache,
)
from loom.attention.reference import causal_mask

CPU = torch.device("cpu")


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q [q_len, H, d] are the last q_len positions of k/v [seq_len, H_kv, d]; explicit softmax loops."""
    q_len, num_heads, d = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for h in range(num_heads):
        kh = h // (num_heads // num_kv_heads)
        scores = q[:, h] @ k[:, kh].T / math.sqrt(d)  # [q_len, seq_len]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores[i, :lo] = float("-inf")
            scores[i, pos + 1 :] = float("-inf")
        out[:, h] = scores.softmax(-1) @ v[:, kh]
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3])
def test_matches_dense_attention_with_cached_context(num_heads: int, num_kv_heads: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, block_size, num_blocks = 8, 4, 32
    seq_lens = [7, 1, 12, 5]
    query_lens = [7, 1, 3, 1]  # full prefill, 1-token prefill, chunk after cached context, decode
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[taken : taken + n])
        taken += n
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU)
    meta.check_invariants()
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    # Context computed by earlier steps goes into the cache first.
    for s, q, k, v, table in zip(seq_lens, query_lens, full_k, full_v, tables):
        ctx = s - q
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv_cache(k[:ctx], v[:ctx], cache, slots.long())
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    key = torch.cat([k[s - q :] for s, q, k in zip(seq_lens, query_lens, full_k)])
    value = torch.cat([v[s - q :] for s, q, v in zip(seq_lens, query_lens, full_v)])
    out = get_attention_backend().forward(query, key, value, cache, meta, head_dim**-0.5, window)
    start = 0
    for s, q, k, v in zip(seq_lens, query_lens, full_k, full_v):
        ref = _dense_attention(query[start : start + q], k, v, window)
        torch.testing.assert_close(out[start : start + q], ref, atol=1e-5, rtol=1e-5)
        start += q


def test_write_kv_cache_skips_pad_slots() -> None:
    cache = torch.zeros(2, 3, 2, 1, 4)
    key = torch.arange(12.0).reshape(3, 1, 4)
    value = -key
    write_kv_cache(key, value, cache, torch.tensor([5, PAD_SLOT_ID, 0]))
    flat = cache.view(2, 6, 1, 4)
    torch.testing.assert_close(flat[0, 5], key[0])
    torch.testing.assert_close(flat[1, 0], value[2])
    assert flat[:, 1:5].abs().sum() == 0


def test_causal_mask_is_bottom_right_aligned() -> None:
    mask = causal_mask(2, 4, None, CPU)
    assert mask is not None
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_mask(1, 9, None, CPU) is None
    windowed = causal_mask(1, 5, 2, CPU)
    assert windowed is not None and windowed.tolist() == [[False, False, False, True, True]]


def test_build_metadata_slot_mapping_and_errors() -> None:
    meta = build_attention_metadata([2, 1], [3, 5], [[7, 2], [4, 9, 1]], 2, CPU)
    assert isinstance(meta, AttentionMetadata)
    # request 0: positions 1, 2 -> block 7 offset 1, block 2 offset 0; request 1: position 4 -> block 1
    assert meta.slot_mapping.tolist() == [15, 4, 2]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 9, 1]]
    assert meta.query_start_loc_cpu == [0, 2, 3] and meta.max_query_len == 2
    with pytest.raises(ValueError, match="block_tables"):
        build_attention_metadata([1], [5], [[0]], 2, CPU)
    with pytest.raises(ValueError, match="query_lens"):
        build_attention_metadata([3], [2], [[0]], 2, CPU)


def test_unknown_backend_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="torch_reference"):
        get_attention_backend("flash")
