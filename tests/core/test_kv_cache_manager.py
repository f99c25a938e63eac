"""KVCacheManager: chained block hashes, prefix hits, reference counts, allocation failure."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loom.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from loom.request import Request

BS = 4


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Look up and allocate the whole request as the scheduler does; returns the hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return num_hit


def test_hash_is_chained_and_deterministic() -> None:
    a = hash_block_tokens(None, (1, 2), ())
    assert a == hash_block_tokens(None, (1, 2), ())
    assert hash_block_tokens(a, (3, 4), ()) != hash_block_tokens(None, (3, 4), ())
    assert hash_block_tokens(None, (1, 2), ("salt",)) != a


def test_block_hashes_follow_prompt_and_output(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(8, BS, True)
    req = make_request("a", range(6))
    manager.update_block_hashes(req)
    assert len(req.block_hashes) == 1
    req.output_token_ids.extend([6, 7])
    manager.update_block_hashes(req)
    assert len(req.block_hashes) == 2
    same = make_request("b", range(8))
    manager.update_block_hashes(same)
    assert same.block_hashes == req.block_hashes  # a block is its tokens, prompt or output alike


def test_shared_prefix_hits_and_reference_counts(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, True)
    a = make_request("a", list(range(10)))
    assert _admit(manager, a) == 0
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert _admit(manager, b) == 8
    shared = manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[:2] == shared
    assert manager.get_block_ids("b")[2] != manager.get_block_ids("a")[2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert manager.prefix_cache_queries == 21 and manager.prefix_cache_hits == 8
    manager.free(a)
    manager.check_invariants()
    assert [manager.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    manager.free(b)
    manager.check_invariants()
    assert manager.num_free_blocks == 16 and manager.usage == 0.0


def test_same_block_tokens_after_a_different_prefix_is_not_a_hit(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, True)
    _admit(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))  # caches [1,2,3,4] then [5,6,7,8]
    _admit(manager, make_request("b", [0, 0, 0, 0, 9]))  # caches [0,0,0,0]
    # Block 0 matches b's, block 1 has a's tokens but followed a different prefix: one block only.
    assert _admit(manager, make_request("c", [0, 0, 0, 0, 5, 6, 7, 8, 9])) == 4


def test_exact_multiple_of_block_size_keeps_the_last_token_uncomputed(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, True)
    _admit(manager, make_request("a", range(8)))
    b = make_request("b", range(8))
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4 and len(hits) == 1  # the second block holds the last token: recomputed
    new = manager.allocate_slots(b, 4, hits, num_hit)
    assert new is not None and len(new) == 1
    manager.check_invariants()


def test_cache_salt_isolates(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, True)
    _admit(manager, make_request("a", range(9), cache_salt="alice"))
    assert _admit(manager, make_request("b", range(9), cache_salt="bob")) == 0
    assert _admit(manager, make_request("c", range(9))) == 0
    assert _admit(manager, make_request("d", range(9), cache_salt="alice")) == 8


def test_prompt_logprobs_skip_the_cache(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, True)
    _admit(manager, make_request("a", range(9)))
    queries = manager.prefix_cache_queries
    assert _admit(manager, make_request("b", range(9), prompt_logprobs=1)) == 0
    assert manager.prefix_cache_queries == queries


def test_disabled_prefix_caching_never_hits(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(16, BS, False)
    _admit(manager, make_request("a", range(9)))
    assert _admit(manager, make_request("b", range(9))) == 0
    assert not manager.block_pool.cached_block_hash_to_block


def test_freed_prefix_stays_findable_until_evicted(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(4, BS, True)
    a = make_request("a", range(9))  # 3 blocks, 2 full
    _admit(manager, a)
    manager.free(a)
    b = make_request("b", range(9))
    assert _admit(manager, b) == 8
    manager.free(b)
    c = make_request("c", range(100, 116))  # 4 blocks: evicts every cached block
    _admit(manager, c)
    manager.free(c)
    assert _admit(manager, make_request("d", range(9))) == 0


def test_failed_allocation_changes_nothing(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(4, BS, True)
    a = make_request("a", range(9))  # blocks 0,1 cached, block 2 partial
    _admit(manager, a)
    manager.free(a)
    other = make_request("x", range(200, 204))
    _admit(manager, other)  # takes one free block; 3 free, 2 of them the cached prefix
    b = make_request("b", list(range(8)) + list(range(300, 308)))  # needs 2 hits + 2 new
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # 2 new blocks + 2 hits sitting in the free queue = 4 > 3 free: must fail and touch nothing.
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert all(h.ref_cnt == 0 for h in hits)
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 3
    manager.check_invariants()


def test_duplicate_full_block_stays_unhashed(make_request: Callable[..., Request]) -> None:
    manager = KVCacheManager(8, BS, True)
    a = make_request("a", range(8), prompt_logprobs=0)  # skips lookup, so both compute block 0
    b = make_request("b", range(8), prompt_logprobs=0)
    _admit(manager, a)
    _admit(manager, b)
    a0, b0 = manager.get_block_ids("a")[0], manager.get_block_ids("b")[0]
    assert a0 != b0
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[a0]
    assert pool.blocks[b0].block_hash is None


def test_invalid_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0, True)
