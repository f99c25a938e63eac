"""Which KV blocks each request holds, with automatic prefix caching over chained block hashes.

Prefix caching follows vLLM v1 (docs/design/prefix_caching.md): the hash of full block i is
H(hash of block i-1, token ids of block i, extra keys), so two blocks match only when their whole
prefix matches. Only full blocks are ever cached.

Two extensions:
  * a host tier (loom.core.offload): cached blocks evicted from the device pool are copied there and
    can be copied back on a later hit; a request preempted in swap mode parks its blocks there;
  * sliding-window models: a block wholly older than the window of every future query is released
    early. Its K/V stay valid for that prefix, so it keeps its hash and may serve another request's
    prefix hit; the request's block table keeps the position and points it at a live block of the
    same request, which the window mask hides from attention. A prefix hit needs only the blocks of
    the last window before it (`longest_cache_hit`).
Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from loom.core.block_pool import BlockPool, KVBlock
from loom.core.offload import HostBlockTier, OffloadCounters, StepCopies
from loom.request import Request


def hash_block_tokens(parent_block_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple[object, ...]) -> int:
    """Chained hash of one full block: 64 bits of SHA-256 over a canonical repr of the inputs.

    Deterministic across processes (unlike `hash()`, which is salted per process for str).
    """
    payload = repr((parent_block_hash, token_ids, extra_keys)).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class ComputedPrefix:
    """What a (re)admitted request need not compute: device hits, then blocks copied back from the host."""

    blocks: list[KVBlock] = field(default_factory=list)  # device prefix-cache hits, position order
    restore_slots: list[int] = field(default_factory=list)  # host slots of the next blocks, position order
    num_tokens: int = 0  # tokens covered; < request.num_tokens (the last token is always computed)


class KVCacheManager:
    """Allocates blocks to requests and finds their longest cached prefix."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
        block_pool: BlockPool | None = None,
        group: int = 0,
    ) -> None:
        """Args: num_host_blocks: capacity of the host tier in blocks (0 = none); sliding_window: tokens
        each query attends back (query included), None = full attention; block_pool: a pool shared with the
        other groups of a hybrid KV cache (HybridKVCacheManager), None = a pool of num_blocks of its own;
        group: this manager's KV cache group, which keys its blocks in the shared prefix cache.

        Raises ValueError when num_blocks or block_size < 1, num_host_blocks < 0 or sliding_window < 1.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size  # tokens per block
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # tokens, or None
        self.host: HostBlockTier | None = HostBlockTier(num_host_blocks) if num_host_blocks > 0 else None
        on_evict = self.host.offload_cached_block if self.host is not None and enable_prefix_caching else None
        if block_pool is not None and self.host is not None:
            raise ValueError("a host tier needs a block pool of the manager's own")
        self.block_pool = block_pool if block_pool is not None else BlockPool(num_blocks, on_evict=on_evict)
        self.group = group
        # request_id -> its blocks, position order; None = released early (outside the sliding window)
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        self.num_window_blocks_freed = 0  # blocks released early by the sliding window, cumulative
        # KV retention (loom/core/kv_retention.py): request_id -> blocks dropped from its table so far. Its table
        # is then compacted: entry j holds position block j + (earlier drops), and every position it computes lies
        # past the dropped blocks, so token p's slot is table[(p - dropped * block_size) // block_size]
        self.num_dropped_blocks: dict[str, int] = {}
        self.num_retention_blocks_freed = 0  # blocks dropped by KV retention policies, cumulative
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found (device or host tier), cumulative
        self.num_blocks_recomputed = 0  # computed blocks dropped by preemptions (not swapped), cumulative
        # blocks lent for one step (the private tails of tree-candidate branches), never hashed
        self._scratch: list[KVBlock] = []
        # (source block id, destination block id): copy-on-write copies of shared partial blocks (beam search
        # forks) recorded by allocate_slots, for the runner to run before the next forward
        self._block_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests, in [0, 1]."""
        return self.block_pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Append to request.block_hashes the hashes of its newly full blocks (prompt and output alike).

        A block is hashed as soon as all its tokens are known; cache_salt keys the first block, and the
        chain carries it to every later block.
        """
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < request.num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra: tuple[object, ...] = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            hashes.append(hash_block_tokens(parent, tuple(request.token_ids_slice(i * bs, (i + 1) * bs)), extra))

    def _key(self, block_hash: int) -> int:
        """The prefix-cache key of a block hash in this manager's group (group 0: the hash itself)."""
        return block_hash if self.group == 0 else hash_block_tokens(block_hash, (), ("kv_group", self.group))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's full blocks: (blocks, num_computed_tokens).

        num_computed_tokens is a multiple of block_size and < request.num_tokens, so the last token is
        always computed (its logits are needed). The blocks are not yet referenced: pass them to
        `allocate_slots` in the same step. Requests asking for prompt_logprobs skip the cache (every
        prompt position must be computed). Queries and hits are counted in tokens.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        blocks = self.longest_cache_hit(request, self._max_hit_blocks(request))
        num_computed = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed
        return blocks, num_computed

    def _max_hit_blocks(self, request: Request) -> int:
        """Most leading full blocks a prefix hit (device or host tier) may cover: all but the last token's, fewer
        under a KV retention policy that scores the prompt's queries (H2O: none, every query is computed;
        SnapKV: the observation window's queries are computed)."""
        last = request.num_tokens - 1
        retention = request.kv_retention
        if retention is not None and retention.policy == "h2o":
            return 0
        if retention is not None and retention.policy == "snapkv":
            last = max(0, request.num_tokens - retention.window)
        return last // self.block_size

    def longest_cache_hit(self, request: Request, max_blocks: int) -> list[KVBlock | None]:
        """The request's longest cached prefix of at most `max_blocks` full blocks, one entry per block (its hashes
        must be up to date; nothing is referenced or counted).

        Full attention needs every block of the prefix, so the hit is the run of cached blocks from block 0. A
        sliding window needs only the blocks the first computed query can see: a prefix of n blocks is a hit when
        the blocks holding positions n * block_size - window + 1 .. n * block_size - 1 are cached, whatever
        became of the earlier ones (vLLM's sliding-window cache hit, docs/design/hybrid_kv_cache_manager.md);
        those earlier entries are None, as if the window had released them, so a long shared prefix still hits
        after its first blocks were evicted. The longest such n is returned (0: an empty list).
        """
        hashes = request.block_hashes[:max_blocks]
        cached = [self.block_pool.get_cached_block(self._key(h)) for h in hashes]
        if self.sliding_window is None:
            n = next((i for i, block in enumerate(cached) if block is None), len(cached))
            return list(cached[:n])
        last_missing = -1  # the last index i < n whose block is not cached, for growing n
        misses_before: list[int] = []
        for i, block in enumerate(cached):
            if block is None:
                last_missing = i
            misses_before.append(last_missing)
        for n in range(len(cached), 0, -1):
            first = max(0, n * self.block_size - self.sliding_window + 1) // self.block_size
            if misses_before[n - 1] < first:
                return [None] * first + list(cached[first:n])
        return []

    def find_computed_prefix(self, request: Request) -> ComputedPrefix:
        """What a waiting request need not compute: device hits, then host-tier blocks.

        A request preempted in swap mode gets its parked blocks back (after any device hits); otherwise
        the device hits are extended by consecutive prefix hits in the host tier (counted as hits).
        Pass the result to `allocate_slots` in the same step.
        """
        blocks, num_hit = self.get_computed_blocks(request)
        if self.host is None:
            return ComputedPrefix(blocks, [], num_hit)
        swapped = self.host.get_swapped(request.request_id)
        if swapped is not None and swapped.num_computed_tokens > num_hit:
            end = _cdiv(swapped.num_computed_tokens, self.block_size)
            return ComputedPrefix(blocks, swapped.host_slots[len(blocks) : end], swapped.num_computed_tokens)
        slots: list[int] = []
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            max_blocks = self._max_hit_blocks(request)
            for block_hash in request.block_hashes[len(blocks) : max_blocks]:
                slot = self.host.lookup(block_hash)
                if slot is None:
                    break
                slots.append(slot)
        num_host_hit = len(slots) * self.block_size
        self.prefix_cache_hits += num_host_hit
        return ComputedPrefix(blocks, slots, num_hit + num_host_hit)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_new_computed_tokens: int = 0,
        restore_slots: list[int] | None = None,
        hits_referenced: bool = False,
    ) -> list[int] | None:
        """Ensure blocks for positions [0, num_computed_tokens + num_new_computed_tokens + num_new_tokens).

        Args:
            request: its num_computed_tokens are the tokens already covered by its blocks.
            num_new_tokens: tokens whose K/V will be computed this step.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (referenced here).
            num_new_computed_tokens: tokens the hits and the restored blocks cover.
            restore_slots: host slots copied back into the first newly allocated blocks (see
                `find_computed_prefix`); the last of them may be partial (a swapped-out request).
            hits_referenced: the caller has already referenced the hits (HybridKVCacheManager references every
                group's hits before any group takes new blocks, so none is handed out as another's new block).

        Returns:
            Ids of the newly allocated blocks (possibly empty), or None when the pool cannot supply them; then
            nothing is allocated and no hit is referenced. Hits that sit in the free queue count
            against the free blocks, since referencing them takes them out of it.

        After allocation, blocks that become full with this step's tokens enter the hash table, and
        with a sliding window the blocks no query of this step or later can see are released.
        """
        assert num_new_tokens >= 0 and num_new_computed_tokens >= 0
        hits = new_computed_blocks or []
        restores = restore_slots or []
        bs = self.block_size
        if restores:
            assert (len(hits) + len(restores) - 1) * bs < num_new_computed_tokens <= (len(hits) + len(restores)) * bs
        else:
            assert len(hits) * bs == num_new_computed_tokens
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed, shared_tail, to_take = self._demand(request, num_new_tokens, hits, num_new_computed_tokens)
        if to_take > self.block_pool.num_free_blocks:
            return None
        if shared_tail is not None:
            self._copy_on_write(request.request_id, shared_tail)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not hits_referenced:
            self.block_pool.touch([b for b in hits if b is not None])
        blocks.extend(hits)  # None: a block outside a sliding window that the hit did not need
        if self.host is not None:
            self.host.pin(restores)  # the evictions below must not hand these slots to an offload
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.host is not None:
            for slot, block in zip(restores, new_blocks, strict=False):
                self.host.restore(slot, block.block_id)
            self.host.release_swapped(request.request_id)
        self._cache_full_blocks(request, num_tokens)
        self._free_outside_window(request.request_id, request.num_computed_tokens + num_new_computed_tokens)
        return [b.block_id for b in new_blocks]

    def num_blocks_to_take(self, request: Request, num_new_tokens: int, hits: list[KVBlock],
                           num_new_computed_tokens: int) -> int:
        """Free blocks `allocate_slots` with these arguments would take from the pool: new blocks, hits now in
        the free queue, and a copy-on-write copy. Releases the blocks outside the window first (as
        allocate_slots does), so that they count as free."""
        return self._demand(request, num_new_tokens, hits, num_new_computed_tokens)[2]

    def _demand(self, request: Request, num_new_tokens: int, hits: list[KVBlock],
                num_new_computed_tokens: int) -> tuple[int, int | None, int]:
        """(new blocks needed, index of a shared partial block to copy on write or None, free blocks taken),
        after releasing the blocks outside the window."""
        self._free_outside_window(request.request_id, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = _cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request.request_id, [])) \
            - len(hits) - self.num_dropped_blocks.get(request.request_id, 0)
        num_hits_free = sum(1 for b in hits if b is not None and b.ref_cnt == 0)
        shared_tail = self._shared_partial_block(request) if num_new_tokens else None
        return num_needed, shared_tail, max(num_needed, 0) + num_hits_free + (shared_tail is not None)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let `child_id` hold the blocks of `parent_id` too (one more reference each; beam search).

        The two share every block, the partial last one included, until one of them writes into that block:
        `allocate_slots` then gives the writer a private copy (copy on write; see take_block_copies). Full
        blocks stay shared for good: their contents never change. The child must hold no blocks yet.
        """
        assert child_id not in self.req_to_blocks, f"request {child_id} already holds blocks"
        blocks = list(self.req_to_blocks.get(parent_id, []))
        self.block_pool.touch([b for b in blocks if b is not None])
        self.req_to_blocks[child_id] = blocks
        if parent_id in self._num_cached_blocks:
            self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]
        if parent_id in self.num_dropped_blocks:
            self.num_dropped_blocks[child_id] = self.num_dropped_blocks[parent_id]

    def _shared_partial_block(self, request: Request) -> int | None:
        """Index of the request's block that its next computed token writes into, when that block already
        holds computed rows and another request holds it too (a fork); None otherwise."""
        position = request.num_computed_tokens
        if position % self.block_size == 0:
            return None  # the next token starts a fresh block
        blocks = self.req_to_blocks.get(request.request_id, [])
        index = position // self.block_size - self.num_dropped_blocks.get(request.request_id, 0)
        if index >= len(blocks) or blocks[index] is None or blocks[index].ref_cnt <= 1:
            return None
        return index

    def _copy_on_write(self, request_id: str, index: int) -> None:
        """Replace the request's shared block `index` by a fresh block holding a copy of its rows (recorded for
        the runner); the shared one loses this reference. Never hashed: it is a partial block."""
        blocks = self.req_to_blocks[request_id]
        shared = blocks[index]
        assert shared is not None and shared.block_hash is None
        (fresh,) = self.block_pool.get_new_blocks(1)
        self._block_copies.append((shared.block_id, fresh.block_id))
        blocks[index] = fresh
        self.block_pool.free_blocks([shared])

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies recorded since the last call: (source block id, destination block id), to run
        before the step's forward pass (after the host tier's copies)."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def _free_outside_window(self, request_id: str, first_query_position: int) -> None:
        """Release the request's blocks that no query at or after `first_query_position` can see.

        A query at position p sees keys p - w + 1 .. p, so block i is dead once its last position
        (i + 1) * block_size - 1 < first_query_position - w + 1.
        """
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_dead = max(0, first_query_position - self.sliding_window + 1) // self.block_size
        dead = [b for b in blocks[:num_dead] if b is not None]
        if not dead:
            return
        for i in range(num_dead):
            blocks[i] = None
        self.block_pool.free_blocks(reversed(dead))
        self.num_window_blocks_freed += len(dead)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching or request.request_id in self.num_dropped_blocks:
            return  # after a retention drop, new K/V depend on the dropped state: never offered to the cache
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            block = blocks[i]
            if block is not None and block.block_hash is None:
                self.block_pool.cache_block(block, self._key(request.block_hashes[i]))
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first (its last blocks are evicted first), and any
        blocks it parked in the host tier."""
        self._free_device_blocks(request)
        if self.host is not None:
            self.host.release_swapped(request.request_id)

    def _free_device_blocks(self, request: Request) -> None:
        self.free_holder(request.request_id)

    def free_holder(self, holder: str) -> None:
        """Release every block held under `holder` (a request id, or a pinned transfer's key), tail first."""
        blocks = self.req_to_blocks.pop(holder, [])
        self._num_cached_blocks.pop(holder, None)
        self.num_dropped_blocks.pop(holder, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def pin(self, request: Request, holder: str) -> list[KVBlock | None]:
        """Move a finished request's blocks to `holder` (a key no request uses), so they stay allocated after the
        request is gone, until `free_holder(holder)`; returns them in position order. Its host-tier blocks are freed."""
        assert holder not in self.req_to_blocks, f"{holder} already holds blocks"
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.num_dropped_blocks.pop(request.request_id, None)
        self.req_to_blocks[holder] = blocks
        if self.host is not None:
            self.host.release_swapped(request.request_id)
        return blocks

    def preempt(self, request: Request, swap: bool) -> bool:
        """Release a preempted request's device blocks; with `swap`, first park its computed blocks in the
        host tier. Returns True when swapped; False when they will be recomputed (counted).

        Swapping falls back to recompute when there is no host tier, it is full, or the sliding window
        already released some of the request's blocks.
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_blocks = _cdiv(request.num_computed_tokens, self.block_size)
        live = [b.block_id for b in blocks[:num_computed_blocks] if b is not None]
        swapped = (
            swap
            and self.host is not None
            and len(live) == num_computed_blocks
            and self.host.swap_out(request.request_id, live, request.num_computed_tokens)
        )
        if not swapped:
            self.num_blocks_recomputed += num_computed_blocks
        self._free_device_blocks(request)
        return swapped

    def drop_blocks(self, request_id: str, indices: list[int]) -> None:
        """Drop entries `indices` (ascending, into the request's table) from a running request's table and release
        their blocks (KV retention). Another holder of a block keeps it untouched; a cached block stays in the
        prefix cache (its contents were computed before any drop). The last entry (the block the next token
        writes into, or the newest) is never dropped.

        Raises:
            ValueError: the request holds no blocks, an index is out of range, repeated, or the last entry.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            raise ValueError(f"request {request_id!r} holds no blocks")
        if sorted(set(indices)) != list(indices) or any(not 0 <= i < len(blocks) - 1 for i in indices):
            raise ValueError(f"indices must be ascending, distinct and below {len(blocks) - 1}, got {indices}")
        if not indices:
            return
        dropped = [blocks[i] for i in indices]
        assert all(b is not None for b in dropped), "retention is not used with a sliding window"
        keep = set(range(len(blocks))) - set(indices)
        blocks[:] = [blocks[i] for i in sorted(keep)]
        self.num_dropped_blocks[request_id] = self.num_dropped_blocks.get(request_id, 0) + len(indices)
        self.num_retention_blocks_freed += len(indices)
        self.block_pool.free_blocks(reversed([b for b in dropped if b is not None]))

    def take_step_copies(self) -> StepCopies:
        """Host-tier copies recorded since the last call (empty without a host tier)."""
        return self.host.take_step_copies() if self.host is not None else StepCopies()

    @property
    def offload_counters(self) -> OffloadCounters:
        """Blocks offloaded, restored and recomputed, cumulative."""
        offloaded, restored = (self.host.num_blocks_offloaded, self.host.num_blocks_restored) if self.host else (0, 0)
        return OffloadCounters(offloaded, restored, self.num_blocks_recomputed)

    def allocate_scratch(self, num_blocks: int) -> list[int] | None:
        """Ids of num_blocks fresh blocks lent until `free_scratch` (the end of the step), or None when the pool
        has fewer free blocks. They are never hashed, so the prefix cache never holds their contents."""
        if num_blocks > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.get_new_blocks(num_blocks)
        self._scratch.extend(blocks)
        return [b.block_id for b in blocks]

    def free_scratch(self) -> None:
        """Return every block `allocate_scratch` lent."""
        self.block_pool.free_blocks(reversed(self._scratch))
        self._scratch = []

    def get_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request in position order (its block_table); [] when it holds none.

        Positions whose block the sliding window released repeat the first live block id: the window
        mask hides them, and a real id keeps every backend's gather in bounds.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        filler = next((b.block_id for b in blocks if b is not None), 0)
        return [filler if b is None else b.block_id for b in blocks]

    def check_invariants(self) -> None:
        """Assert ref counts equal holders, the free queue is the unheld blocks, the hash table is sound."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        self._count_holders(holders, {})
        _check_ref_counts(self.block_pool, holders, self.enable_prefix_caching)
        if self.host is not None:
            self.host.check_invariants()

    def _count_holders(self, holders: list[int], owner: dict[int, int]) -> None:
        """Add this manager's references (requests' blocks, lent scratch blocks) to `holders` [num_blocks],
        asserting no request holds a block twice and (owner: block id -> group, across the groups of a hybrid
        cache) no block is held by two groups."""
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks if b is not None]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice in group {self.group}"
            for block_id in ids:
                holders[block_id] += 1
                assert owner.setdefault(block_id, self.group) == self.group, (
                    f"block {block_id} is held by groups {owner[block_id]} and {self.group}")
        for block in self._scratch:
            holders[block.block_id] += 1


def _check_ref_counts(pool: BlockPool, holders: list[int], enable_prefix_caching: bool) -> None:
    """Assert every block's ref count equals its holders, and no hash table without prefix caching."""
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} holders"
        )
    if not enable_prefix_caching:
        assert not pool.cached_block_hash_to_block


class HybridKVCacheManager:
    """The KV cache of a model whose layers mix attention kinds (Gemma 2 / 3: sliding-window and global layers),
    one KVCacheManager per KV cache group (loom/core/kv_groups.py) over one shared pool of blocks.

    Each group keeps its own block table per request: a full-attention group holds every block of the context, a
    sliding-window group releases the blocks that left its window (loom's sliding-window rule, per group), so a
    long request's local layers hold about a window of blocks. Every group is allocated in the same call, all or
    nothing. Prefix caching keys each group's blocks apart in the shared hash table; a prefix hit is the longest
    prefix every group can serve (a full group: all its blocks cached; a sliding group: those of the last window
    before the prefix ends), so a hit is never longer than what every layer can serve. The host tier (offload, swap) is not supported:
    preemption recomputes; tree candidates get no scratch blocks (one chain per request).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_windows: list[int | None]) -> None:
        """sliding_windows: each group's window in tokens (None = full attention), group order.

        Raises ValueError when num_blocks or block_size < 1, a window < 1, or fewer than two groups.
        """
        if len(sliding_windows) < 2:
            raise ValueError("a hybrid KV cache needs at least two groups")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, 0, window, self.block_pool, g)
                       for g, window in enumerate(sliding_windows)]
        # copy-on-write copies of every group in the order they were recorded (a block freed by a preemption can
        # be a later copy's destination, so the runner must run them in that order)
        self._block_copies: list[tuple[int, int]] = []
        for g in self.groups:
            g._block_copies = self._block_copies
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative
        self.num_blocks_recomputed = 0  # computed blocks (positions, not pages) dropped by preemptions, cumulative

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests, in [0, 1]."""
        return self.block_pool.usage

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock | None]]:
        """The full-attention group's blocks of each request (its holders are every group's holders)."""
        return self.groups[0].req_to_blocks

    @property
    def num_window_blocks_freed(self) -> int:
        """Blocks the sliding groups released early, cumulative."""
        return sum(g.num_window_blocks_freed for g in self.groups)

    @property
    def offload_counters(self) -> OffloadCounters:
        return OffloadCounters(0, 0, self.num_blocks_recomputed)

    def update_block_hashes(self, request: Request) -> None:
        self.groups[0].update_block_hashes(request)

    def find_computed_prefix(self, request: Request) -> ComputedPrefix:
        """The longest prefix every group has cached: ComputedPrefix whose `blocks` is one list per group."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedPrefix([[] for _ in self.groups], [], 0)
        self.update_block_hashes(request)
        # a full group's hit of n blocks is one of every shorter length too, a sliding group's is not (the window
        # before a shorter prefix may be evicted): shrink n until every group has a hit of exactly n blocks
        num_blocks = (request.num_tokens - 1) // self.block_size
        while True:
            per_group = [g.longest_cache_hit(request, num_blocks) for g in self.groups]
            shortest = min(len(blocks) for blocks in per_group)
            if all(len(blocks) == shortest for blocks in per_group):
                break
            num_blocks = shortest
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += shortest * self.block_size
        return ComputedPrefix(per_group, [], shortest * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVBlock]] | None = None, num_new_computed_tokens: int = 0,
                       restore_slots: list[int] | None = None) -> list[int] | None:
        """KVCacheManager.allocate_slots for every group at once (new_computed_blocks: one list per group, from
        `find_computed_prefix`): the ids of every group's new blocks, or None (nothing allocated) when the pool
        cannot supply all of them."""
        assert not restore_slots, "the hybrid KV cache has no host tier"
        hits = new_computed_blocks or [[] for _ in self.groups]
        # hits held by another group's request too count once per group that takes them from the free queue
        needed = sum(g.num_blocks_to_take(request, num_new_tokens, h, num_new_computed_tokens)
                     for g, h in zip(self.groups, hits, strict=True))
        if needed > self.block_pool.num_free_blocks:
            return None
        # every group's hits are referenced first: a hit still in the free queue must not be popped as another
        # group's new block (it would then sit in two groups' tables, and their layers share the page's tensors)
        for h in hits:
            self.block_pool.touch([b for b in h if b is not None])
        new_ids: list[int] = []
        for g, h in zip(self.groups, hits, strict=True):
            ids = g.allocate_slots(request, num_new_tokens, h, num_new_computed_tokens, hits_referenced=True)
            assert ids is not None, "the pool had room for every group"
            new_ids.extend(ids)
        return new_ids

    def fork(self, parent_id: str, child_id: str) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Every group's copy-on-write copies since the last call, in the order they were recorded."""
        copies = list(self._block_copies)
        self._block_copies.clear()  # the groups keep appending to this same list
        return copies

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    def preempt(self, request: Request, swap: bool) -> bool:
        """Release a preempted request's blocks in every group; always recompute (no host tier)."""
        self.num_blocks_recomputed += _cdiv(request.num_computed_tokens, self.block_size)
        for g in self.groups:
            g.preempt(request, swap=False)
        return False

    def take_step_copies(self) -> StepCopies:
        return StepCopies()

    def allocate_scratch(self, num_blocks: int) -> list[int] | None:
        """None: tree candidates' scratch blocks would need one table per group (not supported)."""
        return None

    def free_scratch(self) -> None:
        return None

    def get_block_ids(self, request_id: str) -> list[int]:
        """The full-attention group's block table (KVCacheManager.get_block_ids)."""
        return self.groups[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's block table of the request, group order (KVCacheManager.get_block_ids each)."""
        return [g.get_block_ids(request_id) for g in self.groups]

    def check_invariants(self) -> None:
        """Every group's holders together equal the ref counts, one group per page; every group covers the same
        requests and spans; the free queue and hash table are sound."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        owner: dict[int, int] = {}  # block id -> the group that holds it: a page belongs to one group at a time
        first = self.groups[0].req_to_blocks
        for g in self.groups:
            assert g.req_to_blocks.keys() == first.keys(), "groups hold different requests"
            assert all(len(blocks) == len(first[r]) for r, blocks in g.req_to_blocks.items()), \
                "groups cover different spans"
            g._count_holders(holders, owner)
        _check_ref_counts(self.block_pool, holders, self.enable_prefix_caching)


__all__ = ["ComputedPrefix", "HybridKVCacheManager", "KVCacheManager", "hash_block_tokens"]
