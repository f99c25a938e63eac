"""The engine's side of KV transfer: serve its pinned blocks (producer), pull a prefill's blocks (consumer).

The producer's connector threads read blocks through `EngineKVSource`: the scheduler's thread-safe pinned table
says which block ids a transfer holds (and keeps them from being freed while they are copied); the bytes are
copied out of the paged K/V tensors with no engine lock, which is safe because pinned blocks are never handed
to another request. The consumer's pull runs off the engine thread (the async front calls it in a worker
thread) and never fails a request: any failure is a warning, a counter, and the prompt computed locally.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from loom.core.kv_pinning import PinnedKVTable
from loom.core.sched_output import PinnedKV
from loom.kv_transfer.base import (KVConnector, KVLayout, KVTransferConfig, KVTransferError, KVTransferParams,
                                   RemoteKV, make_kv_connector, prompt_digest)
from loom.kv_transfer.tensors import read_blocks

logger = logging.getLogger(__name__)


class EngineKVSource:
    """KVBlockSource over the scheduler's pinned table and the runner's K/V tensors (read from connector threads)."""

    def __init__(self, layout: KVLayout, pinned: PinnedKVTable, kv_caches: list[torch.Tensor]) -> None:
        self.layout = layout  # this replica's block layout
        self._pinned = pinned  # thread-safe
        self._kv_caches = kv_caches  # per layer [2, num_blocks, block_size, num_kv_heads, row]

    def read_pinned(self, transfer_id: str, num_blocks: int) -> bytearray:
        """KVPayload bytes of the transfer's first num_blocks blocks; the transfer is released after (KeyError:
        unknown, read, released or expired; ValueError: too many blocks)."""
        block_ids = self._pinned.begin_read(transfer_id, num_blocks)
        try:
            return read_blocks(self._kv_caches, block_ids)
        finally:
            self._pinned.end_read(transfer_id)

    def release_pinned(self, transfer_id: str) -> None:
        self._pinned.release(transfer_id)


class KVTransferAgent:
    """One engine's connector, its role, and the pull counters."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, pinned: PinnedKVTable,
                 kv_caches: list[torch.Tensor]) -> None:
        """Starts the producer's KV server when the role includes producer.

        Raises:
            ValueError: unknown connector. OSError: the producer's port cannot be bound.
        """
        self.config = config
        self.layout = layout  # this replica's block layout
        self.connector: KVConnector = make_kv_connector(config.connector, config.host, config.port)
        self.address: tuple[str, int] | None = None  # the producer's KV server (host, port)
        if config.is_producer:
            self.address = self.connector.start_producer(EngineKVSource(layout, pinned, kv_caches))
            logger.info("KV transfer: serving pinned prompt blocks on %s:%d (%s connector, unread blocks freed "
                        "after %.0f s)", *self.address, config.connector, config.timeout_s)
        self._lock = threading.Lock()  # pulls run in worker threads
        self.num_pulls = 0  # successful pulls, cumulative
        self.num_pull_failures = 0  # pulls that fell back to computing the prompt locally, cumulative
        self.num_blocks_pulled = 0  # blocks received, cumulative
        self.pull_seconds = 0.0  # seconds spent in successful pulls, cumulative

    def response_params(self, pinned: PinnedKV) -> dict[str, Any]:
        """The kv_transfer_params a producer's response carries for a request whose blocks it pinned."""
        assert self.address is not None
        return KVTransferParams(remote_host=self.address[0], remote_port=self.address[1],
                                transfer_id=pinned.transfer_id, block_ids=tuple(pinned.block_ids),
                                num_tokens=pinned.num_tokens, prompt_digest=pinned.prompt_digest,
                                layout=self.layout).to_dict()

    def pull(self, params: KVTransferParams, prompt_token_ids: list[int]) -> RemoteKV | None:
        """The producer's K/V for this prompt's full blocks, leaving at least the last prompt token to compute
        (so this replica computes the first output token's logits itself); None when nothing can be used: a
        layout or prompt mismatch, an unreachable or slow producer (each a warning and a counted failure), or a
        prompt shorter than one block plus a token. Thread-safe; never raises."""
        bs = self.layout.block_size
        num_blocks = min(params.num_tokens, len(prompt_token_ids) - 1) // bs
        try:
            params.layout.check_matches(self.layout)
            if prompt_digest(prompt_token_ids[: params.num_tokens]) != params.prompt_digest:
                raise KVTransferError("the prompt differs from the one the prefill replica computed")
            if num_blocks < 1:
                self.connector.release(params, self.config.pull_timeout_s)
                return None
            started = time.perf_counter()
            payload = self.connector.pull(params, num_blocks, self.layout, self.config.pull_timeout_s)
        except KVTransferError as e:
            self.connector.release(params, min(self.config.pull_timeout_s, 2.0))
            with self._lock:
                self.num_pull_failures += 1
            logger.warning("KV pull of transfer %s from %s:%d failed, computing the prompt locally instead: %s",
                           params.transfer_id, params.remote_host, params.remote_port, e)
            return None
        with self._lock:
            self.num_pulls += 1
            self.num_blocks_pulled += num_blocks
            self.pull_seconds += time.perf_counter() - started
        return RemoteKV(payload=payload, num_tokens=num_blocks * bs)

    def close(self) -> None:
        self.connector.close()


__all__ = ["EngineKVSource", "KVTransferAgent"]
