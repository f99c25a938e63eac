"""Bookkeeping of the host KV tier: which host slot holds which block, and the copies to run this step.

The host tier is a bounded second pool of KV blocks (host memory on a GPU machine; the tensors live in
loom/worker/kv_offload.py). It receives
  * blocks evicted from the device prefix cache, keyed by their chained block hash, in LRU order: a later
    prefix-cache miss on the device that hits here copies the block back instead of recomputing it;
  * the computed blocks of a request preempted in swap mode, keyed by request_id, pinned until the
    request resumes (copied back) or ends.
Copies are not run here: each step the scheduler hands the runner `blocks_to_offload` (device block ->
host slot, run first, before any device block is overwritten) and `blocks_to_restore` (host slot ->
device block, run next, before the forward). Two hazards inside one step are avoided: a host slot read
by a restore is pinned until the step's copies are issued, and a slot released this step is reused only
from the next step on. Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class SwappedRequest:
    """A request preempted in swap mode: its computed K/V wait in host slots."""

    host_slots: list[int]  # host slot of each of its blocks, position order
    num_computed_tokens: int  # tokens whose K/V those blocks hold (the last block may be partial)


@dataclass(slots=True, frozen=True)
class OffloadCounters:
    """Cumulative block counts of the host tier (one block = block_size tokens of every layer)."""

    num_blocks_offloaded: int = 0  # device -> host copies (evictions and swap-outs)
    num_blocks_restored: int = 0  # host -> device copies (prefix hits on the host and swap-ins)
    num_blocks_recomputed: int = 0  # computed blocks a preemption dropped (recompute mode, or the host was full)


@dataclass(slots=True)
class StepCopies:
    """The copies of one step, in the order the runner must run them."""

    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot), first
    blocks_to_restore: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id), next


class HostBlockTier:
    """Host slots: free ones, prefix-cache ones (hash -> slot, LRU) and swapped requests' ones."""

    def __init__(self, num_host_blocks: int) -> None:
        """Raises ValueError when num_host_blocks < 1."""
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks  # capacity in blocks
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))  # stack; slot 0 handed out first
        self._cached: OrderedDict[int, int] = OrderedDict()  # block hash -> slot; front = evicted first
        self._slot_hash: dict[int, int] = {}  # slot -> block hash, inverse of _cached
        self._swapped: dict[str, SwappedRequest] = {}  # request_id -> its swapped-out blocks
        self._pinned: set[int] = set()  # slots read by a restore this step
        self._release_after_step: list[int] = []  # slots freed this step, reusable from the next one
        self._copies = StepCopies()
        self.num_blocks_offloaded = 0  # device -> host copies, cumulative
        self.num_blocks_restored = 0  # host -> device copies, cumulative

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def _available(self) -> int:
        """Slots a new entry could get now: free ones plus evictable (unpinned) prefix-cache ones."""
        return len(self._free) + sum(1 for slot in self._cached.values() if slot not in self._pinned)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._cached.items():  # least recently used first
            if slot not in self._pinned:
                del self._cached[block_hash]
                del self._slot_hash[slot]
                return slot
        return None

    # ---- prefix-cache blocks -------------------------------------------------------------------

    def offload_cached_block(self, block_id: int, block_hash: int) -> None:
        """A device block holding `block_hash` is being evicted: keep a copy here (LRU) if room can be made."""
        if block_hash in self._cached:  # the same K/V is already here
            self._cached.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._cached[block_hash] = slot
        self._slot_hash[slot] = block_hash
        self._copies.blocks_to_offload.append((block_id, slot))
        self.num_blocks_offloaded += 1

    def lookup(self, block_hash: int) -> int | None:
        """Host slot holding the block cached under `block_hash`, or None."""
        return self._cached.get(block_hash)

    def pin(self, slots: list[int]) -> None:
        """Keep `slots` from being evicted or reused until this step's copies are issued."""
        self._pinned.update(slots)

    def restore(self, slot: int, block_id: int) -> None:
        """Copy host `slot` into device block `block_id` this step (slot pinned until the copies are issued)."""
        self._pinned.add(slot)
        block_hash = self._slot_hash.get(slot)
        if block_hash is not None:
            self._cached.move_to_end(block_hash)
        self._copies.blocks_to_restore.append((slot, block_id))
        self.num_blocks_restored += 1

    # ---- swapped requests ----------------------------------------------------------------------

    def swap_out(self, request_id: str, block_ids: list[int], num_computed_tokens: int) -> bool:
        """Copy a preempted request's blocks here. Returns False (nothing done) when they do not fit."""
        assert request_id not in self._swapped
        if len(block_ids) > self._available():
            return False
        slots: list[int] = []
        for block_id in block_ids:
            slot = self._take_slot()
            assert slot is not None
            slots.append(slot)
            self._copies.blocks_to_offload.append((block_id, slot))
        self.num_blocks_offloaded += len(block_ids)
        self._swapped[request_id] = SwappedRequest(host_slots=slots, num_computed_tokens=num_computed_tokens)
        return True

    def get_swapped(self, request_id: str) -> SwappedRequest | None:
        return self._swapped.get(request_id)

    def release_swapped(self, request_id: str) -> None:
        """Forget a request's swapped blocks (resumed, or ended); its slots are reusable from the next step."""
        entry = self._swapped.pop(request_id, None)
        if entry is not None:
            self._release_after_step.extend(entry.host_slots)

    # ---- per step ------------------------------------------------------------------------------

    def take_step_copies(self) -> StepCopies:
        """The copies recorded since the last call; unpins and releases the slots of that step."""
        copies, self._copies = self._copies, StepCopies()
        self._pinned.clear()
        self._free.extend(self._release_after_step)
        self._release_after_step.clear()
        return copies

    def check_invariants(self) -> None:
        """Assert every slot is in exactly one place: free, cached, swapped, or released this step."""
        owned = list(self._free) + list(self._cached.values()) + list(self._release_after_step)
        for entry in self._swapped.values():
            owned.extend(entry.host_slots)
        assert sorted(owned) == list(range(self.num_host_blocks)), "host slots lost or shared"
        assert {s: h for h, s in self._cached.items()} == self._slot_hash


__all__ = ["HostBlockTier", "OffloadCounters", "StepCopies", "SwappedRequest"]
