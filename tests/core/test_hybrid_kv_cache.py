"""The hybrid KV cache (Gemma's sliding and global layers): KV cache groups, and HybridKVCacheManager's per-group
block tables over one shared pool."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loom.core.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from loom.core.kv_groups import KVCacheGroup, kv_cache_groups, layer_slots
from loom.request import Request

BS = 4


def test_groups_of_gemma_patterns() -> None:
    # Gemma-3-270M: 18 layers, every 6th global -> 3 global and 15 sliding layers: groups of gcd(3, 15) = 3
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_cache_groups(windows)
    assert groups[0] == KVCacheGroup((5, 11, 17), None)
    assert [g.layers for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert all(g.sliding_window == 512 for g in groups[1:])
    group_of, slot_of = layer_slots(groups, 18)
    assert group_of[11] == 0 and slot_of[11] == 1 and group_of[6] == 2 and slot_of[6] == 2
    # Gemma 2 alternates: two groups of half the layers; Gemma 3 1B (26 layers, 4 global): groups of 2
    assert [len(g.layers) for g in kv_cache_groups([8, None] * 4)] == [4, 4]
    gemma3_1b = kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert len(gemma3_1b) == 13 and all(len(g.layers) == 2 for g in gemma3_1b)
    # layers that attend alike: one group, with their common window
    assert kv_cache_groups([None] * 3) == [KVCacheGroup((0, 1, 2), None)]
    assert kv_cache_groups([7] * 2) == [KVCacheGroup((0, 1), 7)]
    with pytest.raises(ValueError, match="at least one layer"):
        kv_cache_groups([])


def _admit(manager, request: Request) -> bool:
    """Admit a waiting request as the scheduler does: its cached prefix, then the rest of its tokens."""
    return _admit_with(manager, request, manager.find_computed_prefix(request))


def _admit_with(manager, request: Request, prefix) -> bool:  # noqa: ANN001 (ComputedPrefix)
    num_new = request.num_tokens - prefix.num_tokens
    if manager.allocate_slots(request, num_new, prefix.blocks, prefix.num_tokens) is None:
        return False
    request.num_computed_tokens = prefix.num_tokens + num_new
    manager.check_invariants()
    return True


def _decode(manager, request: Request, token: int) -> None:
    """One decode step of a running request."""
    request.output_token_ids.append(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    manager.check_invariants()


def test_sliding_groups_hold_only_their_window(make_request: Callable[..., Request]) -> None:
    """A 40-token request (10 blocks of 4) decoded 20 tokens more: the full group holds all 15 blocks, each sliding
    group (window 6) only the blocks its next query can see, and the pool holds far fewer blocks than with one
    table for every layer; freeing returns everything."""
    hybrid = HybridKVCacheManager(64, BS, True, [None, 6, 6])
    req = make_request("a", range(40), max_tokens=20)
    assert _admit(hybrid, req)
    for t in range(20):
        _decode(hybrid, req, 100 + t)
    full, *sliding = hybrid.groups
    assert len([b for b in full.req_to_blocks["a"] if b is not None]) == 15
    for g in sliding:
        live = [i for i, b in enumerate(g.req_to_blocks["a"]) if b is not None]
        # the next query (position 60) sees 55..60: blocks 13 and 14 (and the block about to be written)
        assert live == [13, 14], live
    assert hybrid.num_window_blocks_freed == 2 * 13
    assert hybrid.block_pool.num_blocks - hybrid.num_free_blocks - sum(
        1 for b in hybrid.block_pool.blocks if b.ref_cnt == 0 and not hybrid.block_pool.is_free(b)) <= 15 + 2 * 2
    tables = hybrid.get_group_block_ids("a")
    assert len(tables) == 3 and all(len(t) == 15 for t in tables)
    assert tables[0] == hybrid.get_block_ids("a")
    hybrid.free(req)
    hybrid.check_invariants()
    assert hybrid.num_free_blocks == 64


def test_allocation_is_all_groups_or_none(make_request: Callable[..., Request]) -> None:
    hybrid = HybridKVCacheManager(10, BS, False, [None, 8])
    big = make_request("a", range(24))  # 6 blocks per group: 12 > 10
    assert hybrid.allocate_slots(big, 24) is None
    hybrid.check_invariants()
    assert hybrid.num_free_blocks == 10 and not hybrid.req_to_blocks
    small = make_request("b", range(16))  # 4 per group
    assert _admit(hybrid, small)
    assert hybrid.num_free_blocks == 2


def test_prefix_hits_are_what_every_group_still_has(make_request: Callable[..., Request]) -> None:
    """A finished request's blocks stay cached in every group; a second request with the same 20-token prefix
    hits 4 blocks (the last token is always computed) in each group, and the groups' keys never collide (the
    same token blocks are cached once per group)."""
    hybrid = HybridKVCacheManager(64, BS, True, [None, 8])
    first = make_request("a", range(20))
    assert _admit(hybrid, first)
    hybrid.free(first)
    assert len(hybrid.block_pool.cached_block_hash_to_block) == 2 * 5
    second = make_request("b", list(range(20)) + [7, 7, 7])
    prefix = hybrid.find_computed_prefix(second)
    assert prefix.num_tokens == 20 and [len(b) for b in prefix.blocks] == [5, 5]
    assert prefix.blocks[0][0] is not prefix.blocks[1][0]
    assert hybrid.prefix_cache_hits == 20 and hybrid.prefix_cache_queries == 20 + 23  # tokens, once per lookup
    assert _admit(hybrid, second)
    hybrid.free(second)
    third = make_request("c", list(range(20)) + [9])
    hybrid.update_block_hashes(third)

    def evict(group: int, block: int) -> None:
        key = hybrid.groups[group]._key(third.block_hashes[block])
        hybrid.block_pool._evict(hybrid.block_pool.cached_block_hash_to_block[key])

    # the sliding group (window 8) lost block 2 (positions 8-11): a query at 20 sees 13..20, blocks 3 and 4, so
    # the hit stays 5 blocks, the sliding group's first three entries None (never needed, never referenced)
    evict(1, 2)
    prefix = hybrid.find_computed_prefix(third)
    assert prefix.num_tokens == 5 * BS and [b is None for b in prefix.blocks[1]] == [True] * 3 + [False] * 2
    # then block 4, inside that window: the longest hit is 4 blocks (a query at 16 sees 9..16, blocks 2 and 3:
    # block 2 is gone too), so 3 blocks (a query at 12 sees 5..12: blocks 1 and 2) ... down to 2 (blocks 0, 1)
    evict(1, 4)
    assert hybrid.find_computed_prefix(third).num_tokens == 2 * BS
    # the full-attention group needs every block: losing its block 1 leaves 1
    evict(0, 1)
    assert hybrid.find_computed_prefix(third).num_tokens == 1 * BS
    prefix = hybrid.find_computed_prefix(third)
    assert _admit_with(hybrid, third, prefix)
    hybrid.check_invariants()


def test_sliding_hit_admits_and_frees_cleanly(make_request: Callable[..., Request]) -> None:
    """A hit whose leading sliding-group entries are None is allocated, referenced and freed with no leaked or
    double-counted block: the None entries cost no block, and the table stays as long as the full group's."""
    hybrid = HybridKVCacheManager(64, BS, True, [None, 8])
    first = make_request("a", range(24))
    assert _admit(hybrid, first)
    hybrid.free(first)
    key = hybrid.groups[1]._key(first.block_hashes[0])  # block 0 of the sliding group
    hybrid.block_pool._evict(hybrid.block_pool.cached_block_hash_to_block[key])
    second = make_request("b", list(range(24)) + [5, 6])
    prefix = hybrid.find_computed_prefix(second)
    # a query at 24 sees 17..24: the sliding group's hit needs only its blocks 4 and 5
    assert prefix.num_tokens == 24 and prefix.blocks[1][:4] == [None] * 4 and None not in prefix.blocks[1][4:]
    hits = prefix.blocks[1][4:]
    assert _admit_with(hybrid, second, prefix)
    hybrid.check_invariants()
    table = hybrid.groups[1].req_to_blocks["b"]
    assert table[:4] == [None] * 4 and table[4:6] == hits and len(table) == 7
    assert all(b.ref_cnt == 1 for b in table[4:])
    # the sliding group's blocks 1..3 of the first request were not needed: still in the free queue, still cached
    unused = [hybrid.block_pool.cached_block_hash_to_block[hybrid.groups[1]._key(h)] for h in first.block_hashes[1:4]]
    assert all(b.ref_cnt == 0 for b in unused)
    hybrid.free(second)
    hybrid.check_invariants()
    assert hybrid.num_free_blocks == 64


def test_preempt_and_fork_cover_every_group(make_request: Callable[..., Request]) -> None:
    hybrid = HybridKVCacheManager(32, BS, True, [None, 8])
    parent = make_request("p", range(10))
    assert _admit(hybrid, parent)
    hybrid.fork("p", "c")
    hybrid.check_invariants()
    assert hybrid.get_group_block_ids("c") == hybrid.get_group_block_ids("p")
    assert hybrid.preempt(parent, swap=True) is False  # no host tier: always recompute
    assert hybrid.offload_counters.num_blocks_recomputed == 3
    assert hybrid.allocate_scratch(1) is None
    child = make_request("c", range(10))
    hybrid.free(child)
    hybrid.check_invariants()
    assert hybrid.num_free_blocks == 32


def test_the_plain_manager_is_unchanged_for_one_group(make_request: Callable[..., Request]) -> None:
    plain = KVCacheManager(16, BS, True)
    req = make_request("a", range(9))
    assert _admit(plain, req)
    assert plain._key(req.block_hashes[0]) == req.block_hashes[0]  # group 0 keys blocks by their own hash


def test_a_free_hit_is_never_another_groups_new_block(make_request: Callable[..., Request]) -> None:
    """Under pressure the blocks a request hits may sit in the free queue, where another group's new blocks are
    taken from: every group's hits are referenced before any group allocates, so no page sits in two groups'
    tables (their layers share its tensors). check_invariants now also asserts one group per page."""
    hybrid = HybridKVCacheManager(16, BS, True, [None, 8])
    first = make_request("a", range(13))
    assert _admit(hybrid, first)
    other = make_request("c", range(100, 116))
    assert _admit(hybrid, other)
    hybrid.free(first)
    hybrid.free(other)
    second = make_request("b", list(range(12)) + list(range(200, 209)))
    assert _admit(hybrid, second)  # check_invariants inside
    full, sliding = hybrid.groups
    live = [b.block_id for b in sliding.req_to_blocks["b"] if b is not None]
    assert not set(full.get_block_ids("b")) & set(live)
    assert hybrid.prefix_cache_hits == 12


def test_copy_on_write_copies_keep_their_order_across_groups(make_request: Callable[..., Request]) -> None:
    """Two beam parents each share a partial block with a fork, in every group; the copies come back in the
    order they were recorded (parent p's in group 0 then 1, then parent q's), not group by group: the runner runs
    them in order, and a block a preemption freed may be a later copy's destination."""
    hybrid = HybridKVCacheManager(48, BS, True, [None, 8])
    parents = [make_request(name, range(6)) for name in ("p", "q")]
    for parent in parents:
        assert _admit(hybrid, parent)
        hybrid.fork(parent.request_id, parent.request_id + "-child")
    hybrid.check_invariants()
    for parent in parents:
        parent.output_token_ids.append(1)
        assert hybrid.allocate_slots(parent, 1) is not None
    copies = hybrid.take_block_copies()
    owner = {b: g.group for g in hybrid.groups for blocks in g.req_to_blocks.values() for b in
             [x.block_id for x in blocks if x is not None]}
    sources = [owner[src] for src, _ in copies]  # the shared partial block each copy reads, by group
    assert sources == [0, 1, 0, 1]
    assert copies[0][0] in hybrid.groups[0].get_block_ids("p-child")
    assert copies[2][0] in hybrid.groups[0].get_block_ids("q-child")
    assert hybrid.take_block_copies() == []
    hybrid.check_invariants()


def test_admission_counts_what_a_hybrid_request_holds_at_once(make_request: Callable[..., Request]) -> None:
    """A request is refused at admission when the pool cannot hold it even alone, which for a hybrid cache is its
    full groups' blocks plus each sliding group's window and chunk, not its token count alone (it would wait
    forever otherwise)."""
    from loom.config import CacheConfig, SchedulerConfig
    from loom.core.scheduler import Scheduler

    def scheduler(num_blocks: int) -> Scheduler:
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256),
                         CacheConfig(block_size=BS, num_blocks=num_blocks), num_blocks, kv_group_windows=[None, 8, 8])

    # 64 tokens: 16 blocks in the full group, min(16, cdiv(8 + 64, 4) + 1) = 16 in each sliding group
    with pytest.raises(ValueError, match="48 KV blocks"):
        scheduler(20).add_request(make_request("a", range(60), max_tokens=4))
    roomy = scheduler(48)
    roomy.add_request(make_request("a", range(60), max_tokens=4))
    for _ in range(8):
        out = roomy.schedule()
        assert out.scheduled or not roomy.waiting
        roomy.update_from_output(out, _fake_output(out))
    assert not roomy.waiting


def _fake_output(out):
    from loom.core.sched_output import ModelRunnerOutput

    return ModelRunnerOutput(sampled_token_ids={r.request_id: [7] for r in out.scheduled if r.sample})
