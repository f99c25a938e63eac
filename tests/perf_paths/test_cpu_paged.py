"""The cpu_paged backend against the reference backend: same outputs and same cache contents."""

from __future__ import annotations

import pytest
import torch

from loom.attention import PAD_SLOT_ID, build_attention_metadata, get_attention_backend, write_kv_cache
from loom.attention.kv_quant import kv_row_width

CPU = torch.device("cpu")
HEAD_DIM = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 40


def _cache(num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """One layer's zeroed paged cache [2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, row]."""
    row = kv_row_width(HEAD_DIM, dtype)
    return torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, row, dtype=dtype)


def _tables(seq_lens: list[int], seed: int) -> list[list[int]]:
    """Disjoint, shuffled block tables covering each seq_len."""
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for seq_len in seq_lens:
        tables.append([free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))])
    return tables


# (query_lens, seq_lens): pure decode, fresh prefills, chunked prefill over cached context, and mixed.
BATCHES = [
    ([1, 1, 1], [5, 17, 9]),
    ([6, 3], [6, 3]),
    ([4, 1, 7, 1], [10, 13, 7, 1]),
    ([1], [1]),
]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("batch", BATCHES)
def test_cpu_paged_matches_reference(
    num_heads: int, num_kv_heads: int, window: int | None, batch: tuple[list[int], list[int]]
) -> None:
    query_lens, seq_lens = batch
    gen = torch.Generator().manual_seed(7)
    tables = _tables(seq_lens, seed=3)
    caches = {name: _cache(num_kv_heads, torch.float32) for name in ("torch_reference", "cpu_paged")}
    # The cached context (positions before this step's queries) is written first, identically in both.
    context = [s - q for q, s in zip(query_lens, seq_lens)]
    if sum(context):
        meta = build_attention_metadata(context, context, tables, BLOCK_SIZE, CPU)
        k = torch.randn(sum(context), num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(sum(context), num_kv_heads, HEAD_DIM, generator=gen)
        for cache in caches.values():
            write_kv_cache(k, v, cache, meta.slot_mapping)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU)
    n = sum(query_lens)
    q = torch.randn(n, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
    outs = {
        name: get_attention_backend(name).forward(q, k, v, caches[name], meta, HEAD_DIM**-0.5, window)
        for name in caches
    }
    torch.testing.assert_close(outs["cpu_paged"], outs["torch_reference"], rtol=1e-5, atol=1e-6)
    assert torch.equal(caches["cpu_paged"], caches["torch_reference"])


def test_cpu_paged_skips_pad_slots_and_reuses_plan_across_layers() -> None:
    """A padded token writes nothing; the same metadata on a second layer gives the same answer."""
    tables = _tables([3, 5], seed=1)
    meta = build_attention_metadata([1, 1], [3, 5], tables, BLOCK_SIZE, CPU)
    meta.slot_mapping[1] = PAD_SLOT_ID
    backend = get_attention_backend("cpu_paged")
    reference = get_attention_backend("torch_reference")
    gen = torch.Generator().manual_seed(0)
    for _layer in range(2):
        cache_a, cache_b = _cache(2, torch.float32), _cache(2, torch.float32)
        q = torch.randn(2, 4, HEAD_DIM, generator=gen)
        k = torch.randn(2, 2, HEAD_DIM, generator=gen)
        v = torch.randn(2, 2, HEAD_DIM, generator=gen)
        out = backend.forward(q, k, v, cache_a, meta, 0.5, None)
        ref = reference.forward(q, k, v, cache_b, meta, 0.5, None)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(cache_a, cache_b)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.bfloat16])
def test_cpu_paged_reads_through_shared_helpers_for_other_cache_dtypes(kv_dtype: torch.dtype) -> None:
    """Quantized and lower-precision caches give the reference backend's answer (same helpers)."""
    query_lens, seq_lens = [3, 1, 1], [3, 9, 6]
    tables = _tables(seq_lens, seed=5)
    gen = torch.Generator().manual_seed(2)
    context = [s - q for q, s in zip(query_lens, seq_lens)]
    caches = [_cache(2, kv_dtype), _cache(2, kv_dtype)]
    meta = build_attention_metadata(context, context, tables, BLOCK_SIZE, CPU)
    k, v = torch.randn(sum(context), 2, HEAD_DIM, generator=gen), torch.randn(sum(context), 2, HEAD_DIM, generator=gen)
    for cache in caches:
        write_kv_cache(k, v, cache, meta.slot_mapping)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU)
    q = torch.randn(5, 4, HEAD_DIM, generator=gen)
    k, v = torch.randn(5, 2, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen)
    out = get_attention_backend("cpu_paged").forward(q, k, v, caches[0], meta, 0.5, None)
    ref = get_attention_backend("torch_reference").forward(q, k, v, caches[1], meta, 0.5, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
