"""Bookkeeping of requests and KV blocks. Plain Python: this package never imports torch."""
