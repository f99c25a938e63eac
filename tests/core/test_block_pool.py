"""BlockPool: LRU free queue, eviction of cached blocks, reference counts."""

from __future__ import annotations

import pytest

from loom.core.block_pool import BlockPool


def test_new_blocks_come_from_the_front_and_hold_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants()


def test_freed_blocks_go_to_the_back_in_the_order_given() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))  # tail first: block 2 is evicted first
    pool.check_invariants()
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 2, 1, 0]


def test_reused_cached_block_loses_its_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, 1234)
    pool.free_blocks([block])
    assert pool.get_cached_block(1234) is block  # freed but still findable
    pool.check_invariants()
    pool.get_new_blocks(1)  # takes the uncached block 1 first
    assert pool.get_cached_block(1234) is block
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None
    assert pool.get_cached_block(1234) is None
    pool.check_invariants()


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 7)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([block])  # a second sharer
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2  # still held once
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.check_invariants()
    assert block.block_id not in [b.block_id for b in pool.get_new_blocks(2)]


def test_duplicate_hash_keeps_the_existing_entry() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_block(first, 99)
    assert not pool.cache_block(second, 99)
    assert second.block_hash is None and pool.get_cached_block(99) is first
    pool.check_invariants()


def test_asking_for_too_many_blocks_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
