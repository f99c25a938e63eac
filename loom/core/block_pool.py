"""The pool of KV blocks: reference counts, an LRU free queue and the prefix-cache hash table.

The design follows vLLM v1's automatic prefix caching (docs/design/prefix_caching.md): a block whose
reference count drops to zero goes to the back of the free queue but keeps its hash, so a later request
with the same prefix can take it back (`touch`) until `get_new_blocks` hands it out again, at which
point its hash-table entry is evicted. Every block id is usable: there is no reserved null block,
because loom pads with PAD_SLOT_ID = -1 in the slot mapping instead of a dummy block.
Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int  # index into the paged K/V tensors, 0 <= block_id < num_blocks
    ref_cnt: int = 0  # number of requests holding this block
    block_hash: int | None = None  # chained prefix hash while the block is in the hash table, else None


class BlockPool:
    """All KV blocks, the free queue (least recently freed first) and hash -> cached block."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, int], None] | None = None) -> None:
        """Create `num_blocks` free, unhashed blocks.

        Args:
            on_evict: called as on_evict(block_id, block_hash) when a cached block is handed out again,
                before anything can overwrite it (the host tier copies it out).

        Raises:
            ValueError: num_blocks < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # blocks in the pool
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front = evicted first); O(1) removal from the middle.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[int, KVBlock] = {}
        self._on_evict = on_evict  # (block_id, block_hash) -> None, or None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached ones included: they can be evicted)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request, in [0, 1]."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free_queue

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` blocks from the front of the free queue, each with ref_cnt 1 and no hash.

        A popped block that was still cached loses its hash-table entry (LRU eviction).

        Raises:
            RuntimeError: fewer than `num_blocks` free blocks (callers check `num_free_blocks` first).
        """
        if num_blocks > len(self._free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block cached under `block_hash`, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 go to the back of the free queue.

        Give a request's blocks tail first, so that its last blocks (the least likely to be shared)
        are evicted before its first ones. Cached blocks keep their hash until reused.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Enter a full block under `block_hash`.

        Returns False (and leaves the block unhashed) when another block already holds that hash:
        the table keeps the existing entry, so the duplicate is simply freed later.
        """
        assert block.block_hash is None and block.ref_cnt > 0
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        assert self.cached_block_hash_to_block.get(block.block_hash) is block
        del self.cached_block_hash_to_block[block.block_hash]
        if self._on_evict is not None:
            self._on_evict(block.block_id, block.block_hash)
        block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the free queue holds exactly the ref_cnt-0 blocks and the hash table is consistent."""
        free_ids = set(self._free_queue)
        assert len(free_ids) == len(self._free_queue)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"block {block.block_id} misplaced"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"hash table entry of block {block.block_id} is stale"
        for block_id, block in self._free_queue.items():
            assert self.blocks[block_id] is block


__all__ = ["KVBlock", "BlockPool"]
