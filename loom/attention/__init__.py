"""Paged attention: metadata, the backend Protocol and registry, and the backends."""

from loom.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    gather_kv,
    get_attention_backend,
    write_kv_cache,
)
from loom.attention.metadata import PAD_SLOT_ID, AttentionMetadata, build_attention_metadata

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "PAD_SLOT_ID",
    "build_attention_metadata",
    "gather_kv",
    "get_attention_backend",
    "write_kv_cache",
]
