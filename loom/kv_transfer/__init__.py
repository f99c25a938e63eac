"""KV transfer between replicas (prefill/decode disaggregation): loom/kv_transfer/base.py holds the seam."""

from loom.kv_transfer.base import (KVConnector, KVLayout, KVLayoutMismatchError, KVPayload, KVTransferError,
                                   KVTransferParams, make_kv_connector, parse_kv_transfer_request)

__all__ = ["KVConnector", "KVLayout", "KVLayoutMismatchError", "KVPayload", "KVTransferError", "KVTransferParams",
           "make_kv_connector", "parse_kv_transfer_request"]
