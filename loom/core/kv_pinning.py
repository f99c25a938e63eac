"""KV blocks kept pinned after their request finished, until a decode replica pulls them (disaggregation).

A prefill replica's request that asked for remote decode keeps its prompt's blocks when it ends: the scheduler
hands them to an owner key of their own in the KV cache manager (so they are neither freed nor reused) and
records them here. The KV transfer server reads them from its own threads, so this table is the one piece of
scheduler state shared across threads: every method takes the lock. A transfer ends when it was read, released
unread, or its deadline passed while nobody was reading it; the scheduler then frees its blocks on the engine
thread (`take_released`). Plain Python, no torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(slots=True)
class PinnedTransfer:
    """One request's pinned prompt blocks."""

    transfer_id: str  # the handle a consumer pulls with
    owner: str  # the key holding the blocks in the KV cache manager's req_to_blocks
    block_ids: list[int]  # position order, cdiv(num_tokens, block_size) of them
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    prompt_digest: str  # digest of those tokens (loom.kv_transfer.base.prompt_digest)
    deadline: float  # time.monotonic() seconds after which an unread transfer is freed
    reading: bool = False  # a consumer is copying the blocks now: they must not be freed yet
    done: bool = False  # read or released: free at the next take_released


class PinnedKVTable:
    """Thread-safe table of pinned transfers: written by the engine thread, read by the KV server's threads."""

    def __init__(self, timeout_s: float) -> None:
        """timeout_s: seconds an unread transfer stays pinned. Raises ValueError when not > 0."""
        if not timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._entries: dict[str, PinnedTransfer] = {}  # transfer_id -> its blocks
        self.num_pinned_total = 0  # transfers pinned, cumulative
        self.num_read_total = 0  # transfers read by a consumer, cumulative
        self.num_expired_total = 0  # transfers freed unread by the timeout, cumulative

    def pin(self, transfer: PinnedTransfer) -> None:
        """Record a transfer (engine thread). Its deadline is set by the caller."""
        with self._lock:
            assert transfer.transfer_id not in self._entries, f"transfer {transfer.transfer_id} pinned twice"
            self._entries[transfer.transfer_id] = transfer
            self.num_pinned_total += 1

    def get(self, transfer_id: str) -> PinnedTransfer | None:
        with self._lock:
            return self._entries.get(transfer_id)

    def begin_read(self, transfer_id: str, num_blocks: int) -> list[int]:
        """Claim a transfer for reading (KV server thread): the first num_blocks block ids, which stay valid until
        `end_read`. A transfer is read once.

        Raises:
            KeyError: unknown, already read or being read, released, or expired.
            ValueError: num_blocks outside [1, blocks pinned].
        """
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is None or entry.reading or entry.done:
                raise KeyError(transfer_id)
            if not 1 <= num_blocks <= len(entry.block_ids):
                raise ValueError(f"num_blocks must be in [1, {len(entry.block_ids)}], got {num_blocks}")
            entry.reading = True
            return entry.block_ids[:num_blocks]

    def end_read(self, transfer_id: str) -> None:
        """The blocks were copied out (or the copy failed): free them at the next take_released."""
        with self._lock:
            entry = self._entries[transfer_id]
            entry.reading, entry.done = False, True
            self.num_read_total += 1

    def release(self, transfer_id: str) -> None:
        """Free a transfer unread at the next take_released (unknown ids ignored; a read in progress ends it)."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None and not entry.reading:
                entry.done = True

    def take_released(self, now: float) -> list[PinnedTransfer]:
        """Remove and return the transfers to free now (engine thread): read or released ones, and unread ones
        past their deadline that no consumer is reading."""
        with self._lock:
            out = [e for e in self._entries.values() if e.done or (not e.reading and now >= e.deadline)]
            for e in out:
                del self._entries[e.transfer_id]
                self.num_expired_total += not e.done
            return out

    def owners(self) -> set[str]:
        """The KV cache manager keys of every pinned transfer."""
        with self._lock:
            return {e.owner for e in self._entries.values()}

    def num_blocks(self) -> int:
        """Blocks held by all pinned transfers (a block shared by two transfers counts twice: an upper bound)."""
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


__all__ = ["PinnedKVTable", "PinnedTransfer"]
