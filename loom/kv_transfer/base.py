"""The KV-transfer seam of prefill/decode disaggregation: what travels, the connector Protocol, a registry.

Pull-based, as vLLM's NIXL connector: a prefill replica (the producer) computes a request's prompt K/V, keeps its
blocks pinned and answers with `KVTransferParams` (where to fetch them, which blocks, their layout); a decode
replica (the consumer) pulls those blocks through a `KVConnector`, checks their `KVLayout` against its own, writes
them into its own blocks and continues the request. The producer frees the blocks once they are read, released
or a timeout passed. No torch here: the bytes are opaque; loom/kv_transfer/tensors.py moves them in and out of
the paged K/V tensors.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

PARAM = "kv_transfer_params"  # the request body field; user errors name it
KV_TRANSFER_ROLES = ("producer", "consumer", "both")  # --kv-transfer-role


class KVTransferError(RuntimeError):
    """A pull failed (producer gone, unknown or expired transfer, timeout, short read). The consumer falls back to
    computing the prompt itself."""


class KVLayoutMismatchError(KVTransferError):
    """The blocks on offer are not laid out as this replica's: loading them would be garbage, so they are refused."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one KV block is laid out: two replicas exchange blocks only when every field is equal."""

    num_layers: int  # layers whose K/V a block holds (all of the model's)
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # values per head
    row_bytes: int  # bytes of one (token slot, KV head) row, scale bytes of int8/fp8 caches included
    block_size: int  # tokens per block
    kv_dtype: str  # the cache dtype, e.g. "torch.float32"
    model: str  # identity of the weights (name and size of the checkpoint); "" = unknown

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Any, name: str = f"{PARAM}.layout") -> "KVLayout":
        """Raises ValueError naming `name` (or its field) for a missing or mistyped field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{name} must be an object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for field_name, kind in (("num_layers", int), ("num_kv_heads", int), ("head_dim", int), ("row_bytes", int),
                                 ("block_size", int), ("kv_dtype", str), ("model", str)):
            value = data.get(field_name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{name}.{field_name} must be {kind.__name__}, got {value!r}")
            values[field_name] = value
        return cls(**values)

    def check_matches(self, local: "KVLayout") -> None:
        """Refuse blocks laid out differently from `local` (this replica's layout).

        Raises:
            KVLayoutMismatchError: naming every field that differs, with both values.
        """
        diffs = [f"{n}: remote {getattr(self, n)!r} != local {getattr(local, n)!r}"
                 for n in self.__dataclass_fields__ if getattr(self, n) != getattr(local, n)]
        if diffs:
            raise KVLayoutMismatchError("KV block layout mismatch (" + "; ".join(diffs) + ")")


def prompt_digest(token_ids: list[int]) -> str:
    """A short hex digest of the token ids whose K/V are transferred: the consumer loads them only for the same
    tokens (SHA-256 over their decimal form; 16 hex digits)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """What a producer's response carries back (and what the consumer's request carries in): where and which."""

    remote_host: str  # the producer's KV server address
    remote_port: int  # its TCP port
    transfer_id: str  # the pinned blocks' handle on the producer
    block_ids: tuple[int, ...]  # the producer's block ids, position order (cdiv(num_tokens, block_size) of them)
    num_tokens: int  # prompt tokens whose K/V those blocks hold
    prompt_digest: str  # prompt_digest(prompt_token_ids[:num_tokens]) on the producer
    layout: KVLayout  # how the producer's blocks are laid out

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of a producer's response (`do_remote_prefill` is what the consumer's request needs)."""
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_host": self.remote_host,
                "remote_port": self.remote_port, "transfer_id": self.transfer_id, "block_ids": list(self.block_ids),
                "num_tokens": self.num_tokens, "prompt_digest": self.prompt_digest, "layout": self.layout.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVTransferParams":
        """Raises ValueError naming kv_transfer_params.<field> for a missing or mistyped field."""
        def need(name: str, kind: type) -> Any:
            value = data.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{PARAM}.{name} must be {kind.__name__} (do_remote_prefill needs the fields the "
                                 f"prefill replica returned), got {value!r}")
            return value

        block_ids = need("block_ids", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
            raise ValueError(f"{PARAM}.block_ids must be a list of block ids >= 0")
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise ValueError(f"{PARAM}.remote_port must be in [1, 65535], got {port}")
        num_tokens = need("num_tokens", int)
        layout = KVLayout.from_dict(data.get("layout"))
        if num_tokens < 1 or -(-num_tokens // layout.block_size) != len(block_ids):
            raise ValueError(f"{PARAM}.num_tokens ({num_tokens}) must be >= 1 and fill the {len(block_ids)} "
                             f"block_ids of {layout.block_size} tokens")
        return cls(remote_host=need("remote_host", str), remote_port=port, transfer_id=need("transfer_id", str),
                   block_ids=tuple(block_ids), num_tokens=num_tokens, prompt_digest=need("prompt_digest", str),
                   layout=layout)


@dataclass(frozen=True, slots=True)
class KVTransferRequest:
    """A request's `kv_transfer_params`, validated: one of the two roles."""

    do_remote_decode: bool  # producer side: prefill, keep the blocks pinned, return where they are
    remote: KVTransferParams | None  # consumer side (do_remote_prefill): the blocks to pull; None otherwise


def parse_kv_transfer_request(data: Any) -> KVTransferRequest | None:
    """Validate a request body's kv_transfer_params (None or {} = no transfer).

    Raises:
        ValueError: naming kv_transfer_params (or its field): not an object, both or neither role set,
            do_remote_prefill without the producer's fields.
    """
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ValueError(f"{PARAM} must be an object, got {type(data).__name__}")
    if not data:
        return None
    decode, prefill = data.get("do_remote_decode", False), data.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        raise ValueError(f"{PARAM}.do_remote_decode and do_remote_prefill must be booleans")
    if decode == prefill:
        raise ValueError(f"{PARAM} must set exactly one of do_remote_decode (this replica prefills) and "
                         f"do_remote_prefill (this replica pulls the prefill's K/V)")
    return KVTransferRequest(True, None) if decode else KVTransferRequest(False, KVTransferParams.from_dict(data))


@dataclass(slots=True)
class KVPayload:
    """Blocks pulled from a producer: host bytes, layer-major [num_layers, 2, num_blocks, block bytes of a layer]."""

    layout: KVLayout  # the producer's layout (checked equal to the consumer's on arrival)
    num_blocks: int  # blocks in `data`, position order from the transfer's first block
    data: bytes | bytearray  # num_blocks * layout.block_bytes bytes


@dataclass(slots=True)
class RemoteKV:
    """A consumer request's pulled prompt K/V, waiting for admission (the scheduler treats `payload` as opaque)."""

    payload: KVPayload  # the blocks
    num_tokens: int  # prompt tokens they cover: a multiple of block_size, < the prompt's length


class KVBlockSource(Protocol):
    """What a producer's connector serves from: the engine's pinned blocks. Called from the connector's threads."""

    layout: KVLayout  # the producer's block layout

    def read_pinned(self, transfer_id: str, num_blocks: int) -> bytes | bytearray:
        """The first num_blocks pinned blocks of a transfer as KVPayload bytes, then release them.

        Raises:
            KeyError: unknown, released or expired transfer; ValueError: more blocks than it pins.
        """
        ...

    def release_pinned(self, transfer_id: str) -> None:
        """Release a transfer's blocks unread (unknown ids are ignored)."""
        ...


class KVConnector(Protocol):
    """Moves pinned KV blocks from a producer replica to a consumer replica."""

    def start_producer(self, source: KVBlockSource) -> tuple[str, int]:
        """Start serving `source`'s pinned blocks; returns the (host, port) consumers reach it at."""
        ...

    def pull(self, params: KVTransferParams, num_blocks: int, local: KVLayout, timeout_s: float) -> KVPayload:
        """Fetch the first num_blocks blocks of a transfer (the producer releases them once sent).

        Raises:
            KVLayoutMismatchError: the producer's layout is not `local`; KVTransferError: any other failure.
        """
        ...

    def release(self, params: KVTransferParams, timeout_s: float) -> None:
        """Tell the producer to free a transfer that will not be pulled. Best effort: never raises."""
        ...

    def close(self) -> None:
        """Stop serving (producer); idempotent."""
        ...


# connector name -> "module:factory"; a factory takes the producer's listen host and port (0 = any free port)
KV_CONNECTORS: Mapping[str, str] = MappingProxyType({"tcp": "loom.kv_transfer.tcp:TCPConnector"})


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """`loom serve --kv-transfer-role ...`: this replica's part in prefill/decode disaggregation."""

    role: str  # producer (prefills, serves blocks) | consumer (pulls them, decodes) | both
    connector: str = "tcp"  # registry name (loom.kv_transfer.base.KV_CONNECTORS)
    host: str = "127.0.0.1"  # producer: the address its KV server listens on and advertises
    port: int = 0  # producer: its KV server port; 0 = any free port
    timeout_s: float = 120.0  # producer: seconds a finished request's unread blocks stay pinned
    pull_timeout_s: float = 10.0  # consumer: seconds one pull may take before the prompt is computed locally
    # consumer: the producers' hosts it may connect to ("*": any). A request names the host to pull from, so
    # without this list any client could make the replica connect anywhere and load K/V it did not compute.
    peers: tuple[str, ...] = ("127.0.0.1", "::1", "localhost")

    def __post_init__(self) -> None:
        if self.role not in KV_TRANSFER_ROLES:
            raise ValueError(f"kv_transfer_role must be one of {KV_TRANSFER_ROLES}, got {self.role!r}")
        if self.connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(KV_CONNECTORS)}, got {self.connector!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"kv_transfer_port must be in [0, 65535], got {self.port}")
        if not self.timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.timeout_s}")
        if not self.pull_timeout_s > 0:
            raise ValueError(f"kv_transfer_pull_timeout_s must be > 0, got {self.pull_timeout_s}")

    def allows_peer(self, host: str) -> bool:
        """Whether a consumer may pull from `host` (as written in kv_transfer_params' remote_host)."""
        return "*" in self.peers or host in self.peers

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")


def make_kv_connector(name: str, host: str, port: int) -> KVConnector:
    """The connector registered under `name`.

    Raises:
        ValueError: unknown name (kv_connector; the message lists the known ones).
    """
    target = KV_CONNECTORS.get(name)
    if target is None:
        raise ValueError(f"kv_connector must be one of {sorted(KV_CONNECTORS)}, got {name!r}")
    module, factory = target.split(":")
    return getattr(importlib.import_module(module), factory)(host, port)


__all__ = ["KVBlockSource", "KVConnector", "KVLayout", "KVLayoutMismatchError", "KVPayload", "KVTransferError",
           "KVTransferConfig", "KVTransferParams", "KVTransferRequest", "KV_CONNECTORS", "KV_TRANSFER_ROLES", "PARAM", "RemoteKV",
           "make_kv_connector", "parse_kv_transfer_request", "prompt_digest"]
