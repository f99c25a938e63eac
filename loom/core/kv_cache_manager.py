"""Which KV blocks each request holds, with automatic prefix caching over chained block hashes.

Prefix caching follows vLLM v1 (docs/design/prefix_caching.md): the hash of full block i is
H(hash of block i-1, token ids of block i, extra keys), so two blocks match only when their whole
prefix matches. Only full blocks are ever cached. Plain Python, no torch.
"""

from __future__ import annotations

import hashlib

from loom.core.block_pool import BlockPool, KVBlock
from loom.request import Request


def hash_block_tokens(parent_block_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple[object, ...]) -> int:
    """Chained hash of one full block: 64 bits of SHA-256 over a canonical repr of the inputs.

    Deterministic across processes (unlike `hash()`, which is salted per process for str).
    """
    payload = repr((parent_block_hash, token_ids, extra_keys)).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks to requests and finds their longest cached prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        """Raises ValueError when num_blocks or block_size < 1."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size  # tokens per block
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # request_id -> its blocks, position order
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative

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
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed
        return blocks, num_computed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Ensure blocks for positions [0, num_computed_tokens + num_new_computed_tokens + num_new_tokens).

        Args:
            request: its num_computed_tokens are the tokens already covered by its blocks.
            num_new_tokens: tokens whose K/V will be computed this step.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (referenced here).
            num_new_computed_tokens: tokens those hits cover (len(new_computed_blocks) * block_size).

        Returns:
            Ids of the newly allocated blocks (possibly empty), or None when the pool cannot supply them; then
            nothing is allocated and no hit is referenced. Hits that sit in the free queue count
            against the free blocks, since referencing them takes them out of it.

        After allocation, blocks that become full with this step's tokens enter the hash table.
        """
        assert num_new_tokens >= 0 and num_new_computed_tokens >= 0
        hits = new_computed_blocks or []
        assert len(hits) * self.block_size == num_new_computed_tokens
        held = self.req_to_blocks.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = _cdiv(num_tokens, self.block_size) - len(held) - len(hits)
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_needed, 0) + num_hits_free > self.block_pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.block_pool.touch(hits)
        blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            if blocks[i].block_hash is None:
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first (its last blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request in position order (its block_table); [] when it holds none."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_invariants(self) -> None:
        """Assert ref counts equal holders, the free queue is the unheld blocks, the hash table is sound."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
            for block_id in ids:
                holders[block_id] += 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} holders"
            )
        if not self.enable_prefix_caching:
            assert not self.block_pool.cached_block_hash_to_block


__all__ = ["KVCacheManager", "hash_block_tokens"]
