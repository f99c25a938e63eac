"""The TCP connector: blocks round-trip bit-exact, a layout mismatch is refused, failures are KVTransferError."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from loom.kv_transfer.base import (KVLayoutMismatchError, KVTransferError, KVTransferParams, make_kv_connector,
                                   parse_kv_transfer_request, prompt_digest)
from loom.kv_transfer.tensors import kv_layout, read_blocks, write_blocks


class _Source:
    """A producer's pinned blocks over real cache tensors."""

    def __init__(self, caches: list[torch.Tensor], block_size: int, pinned: dict[str, list[int]]) -> None:
        self.caches = caches
        self.layout = kv_layout(caches, block_size, head_dim=8, model="tiny")
        self.pinned = pinned
        self.released: list[str] = []
        self.lock = threading.Lock()

    def read_pinned(self, transfer_id: str, num_blocks: int) -> bytearray:
        with self.lock:
            ids = self.pinned.pop(transfer_id)
            self.released.append(transfer_id)
        if num_blocks > len(ids):
            raise ValueError("too many blocks")
        return read_blocks(self.caches, ids[:num_blocks])

    def release_pinned(self, transfer_id: str) -> None:
        with self.lock:
            if self.pinned.pop(transfer_id, None) is not None:
                self.released.append(transfer_id)


def _caches(dtype: torch.dtype, num_blocks: int = 6, block_size: int = 4, layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        return [torch.randint(-128, 127, (2, num_blocks, block_size, 2, 12), generator=g, dtype=torch.int8)
                for _ in range(layers)]
    return [torch.randn(2, num_blocks, block_size, 2, 8, generator=g).to(dtype) for _ in range(layers)]


def _params(source: _Source, host: str, port: int, tid: str, block_ids: list[int], bs: int = 4) -> KVTransferParams:
    return KVTransferParams(remote_host=host, remote_port=port, transfer_id=tid, block_ids=tuple(block_ids),
                            num_tokens=len(block_ids) * bs, prompt_digest="x", layout=source.layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_blocks_round_trip_bit_exact(dtype: torch.dtype) -> None:
    src_caches = _caches(dtype)
    source = _Source(src_caches, 4, {"t1": [4, 1, 3]})
    producer = make_kv_connector("tcp", "127.0.0.1", 0)
    host, port = producer.start_producer(source)
    try:
        dst_caches = [torch.zeros_like(c) for c in src_caches]
        consumer = make_kv_connector("tcp", "127.0.0.1", 0)
        local = kv_layout(dst_caches, 4, head_dim=8, model="tiny")
        payload = consumer.pull(_params(source, host, port, "t1", [4, 1, 3]), 2, local, timeout_s=5.0)
        assert payload.num_blocks == 2 and source.released == ["t1"]
        write_blocks(dst_caches, payload, [0, 1], [5, 0])  # producer blocks 4, 1 -> consumer blocks 5, 0
        for src, dst in zip(src_caches, dst_caches):
            assert torch.equal(dst[:, 5].view(torch.uint8), src[:, 4].view(torch.uint8))
            assert torch.equal(dst[:, 0].view(torch.uint8), src[:, 1].view(torch.uint8))
            assert not dst[:, 1:5].view(torch.uint8).any()  # nothing else written
        with pytest.raises(KVTransferError, match="unknown or expired"):  # a read releases: a second read fails
            consumer.pull(_params(source, host, port, "t1", [4, 1, 3]), 2, local, timeout_s=5.0)
    finally:
        producer.close()


def test_layout_mismatch_is_refused_naming_the_field() -> None:
    source = _Source(_caches(torch.float32), 4, {"t": [0, 1]})
    producer = make_kv_connector("tcp", "127.0.0.1", 0)
    host, port = producer.start_producer(source)
    try:
        consumer = make_kv_connector("tcp", "127.0.0.1", 0)
        local = dataclasses.replace(source.layout, num_kv_heads=3)
        with pytest.raises(KVLayoutMismatchError, match="num_kv_heads: remote 2 != local 3"):
            consumer.pull(_params(source, host, port, "t", [0, 1]), 2, local, timeout_s=5.0)
        other_model = dataclasses.replace(source.layout, model="other")
        with pytest.raises(KVLayoutMismatchError, match="model"):
            source.layout.check_matches(other_model)
    finally:
        producer.close()


def test_producer_gone_and_release() -> None:
    source = _Source(_caches(torch.float32), 4, {"a": [0], "b": [1]})
    producer = make_kv_connector("tcp", "127.0.0.1", 0)
    host, port = producer.start_producer(source)
    consumer = make_kv_connector("tcp", "127.0.0.1", 0)
    consumer.release(_params(source, host, port, "a", [0]), timeout_s=5.0)
    assert source.released == ["a"]
    producer.close()
    with pytest.raises(KVTransferError):
        consumer.pull(_params(source, host, port, "b", [1]), 1, source.layout, timeout_s=2.0)
    consumer.release(_params(source, host, port, "b", [1]), timeout_s=1.0)  # best effort: no raise


def test_request_field_validation_names_the_parameter() -> None:
    assert parse_kv_transfer_request(None) is None and parse_kv_transfer_request({}) is None
    assert parse_kv_transfer_request({"do_remote_decode": True}).do_remote_decode
    for bad in ("yes", {"do_remote_decode": True, "do_remote_prefill": True}, {"do_remote_decode": 1},
                {"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
                                               "transfer_id": "t", "block_ids": [0], "num_tokens": 9,
                                               "prompt_digest": "d", "layout": {}}):
        with pytest.raises(ValueError, match="kv_transfer_params"):
            parse_kv_transfer_request(bad)
    source = _Source(_caches(torch.float32), 4, {})
    good = _params(source, "h", 9, "t", [3, 4]).to_dict()
    parsed = parse_kv_transfer_request(good)
    assert parsed.remote == KVTransferParams.from_dict(good) and parsed.remote.block_ids == (3, 4)
    assert prompt_digest([1, 2]) != prompt_digest([12])
