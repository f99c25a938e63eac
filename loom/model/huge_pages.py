"""Weights on 2 MB pages: a decode step streams every weight once, and on 4 KB pages that is a TLB miss every 4 KB.

At 4 bits a SmolLM2-135M step reads ~96 MB: ~24,000 4 KB pages, far more than the second-level TLB holds, so every
page of every step is a page walk, and in a virtual machine (nested paging) a walk costs several memory reads. On
2 MB pages the same bytes are 48 pages. Measured on a 2-core Ice Lake-class VM (the 120 q4g layer matrices and the
q8g LM head of SmolLM2 at M = 1, the same bytes on 4 KB and on 2 MB pages, alternated in one process): the layers
0.86-0.90x and the LM head 0.83-0.89x the time (benchmarks/NOTES.md, "Issue 9: the per-token overhead of a single
stream").

`place_weights_on_huge_pages` copies a loaded model's CPU weights (parameters, buffers and packed matrices of at
least 64 KiB) into anonymous mappings aligned to 2 MB and advised MADV_HUGEPAGE (Linux transparent huge pages;
`/sys/kernel/mm/transparent_hugepage/enabled` must be `always` or `madvise`), in module order, and rebinds each
tensor to its copy: values, shapes and dtypes are unchanged, only where they live. Elsewhere (no MADV_HUGEPAGE, a
GPU model) and with LOOM_HUGE_PAGES=0 (or false, no, off) it moves nothing. Whether the kernel then backs the mappings with huge pages
is its own decision (free 2 MB frames); /proc/self/smaps shows it (AnonHugePages).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch
from torch import nn

from loom.env import env_flag
from loom.quant.layout import PackedWeight

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: the x86-64 and arm64 (4 KB granule) transparent huge page
CHUNK_BYTES = 64 << 20  # bytes per mapping (a tensor larger than this gets one of its own size)
MIN_BYTES = 64 << 10  # tensors smaller than this stay where they are (norm weights, biases)


def huge_pages_available() -> bool:
    """Whether this platform can advise huge pages (Python's mmap has MADV_HUGEPAGE: Linux) and the switch
    LOOM_HUGE_PAGES is on (the default; loom/env.py reads it).

    Raises:
        ValueError: LOOM_HUGE_PAGES is not an on/off value.
    """
    return hasattr(mmap, "MADV_HUGEPAGE") and env_flag("LOOM_HUGE_PAGES", True)


class HugePageArena:
    """Bump allocation of tensors in 2 MB-aligned anonymous mappings advised MADV_HUGEPAGE (each mapping stays
    alive as long as a tensor in it does: torch.frombuffer keeps a reference to it)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.mapped = 0  # bytes mapped in all
        self.placed = 0  # bytes of tensors placed
        self._chunk: torch.Tensor | None = None  # uint8 view of the current mapping from its aligned start
        self._used = 0

    def _map(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        # private (a shared anonymous mapping would be shmem, whose huge pages follow another setting)
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(region, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE
        self._chunk, self._used = raw[skip : skip + size], 0
        self.mapped += size + HUGE_PAGE

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` inside the arena (64-byte aligned): zeros where the arena's memory was
        not written before (a fresh mapping reads as zeros; its pages are committed as they are first written)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._map(nbytes)
        assert self._chunk is not None
        view = self._chunk[self._used : self._used + nbytes].view(dtype).view(shape)
        self._used += -(-nbytes // 64) * 64
        self.placed += nbytes
        return view

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of a contiguous CPU tensor inside the arena (64-byte aligned), same dtype and shape."""
        view = self.empty(tuple(tensor.shape), tensor.dtype)
        view.copy_(tensor)
        return view


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a mapping of its own, 2 MB-aligned and advised MADV_HUGEPAGE (the paged KV cache:
    decode attention reads its blocks in any order, a page walk per 4 KB page touched on small pages); torch.zeros
    where huge pages are not available.

    Its memory is committed here, by writing the zeros, as torch.zeros and llama.cpp's KV buffer clear do: left to
    the first write of each page, the commit lands in whichever decode step touches a block first. In a virtual
    machine a page the guest has not used lately costs a host fault too: 0.5 GiB took 2.3 s to first touch on a
    2-core Zen 4 VM (0.07 s once backed), ~9% of a speculative-decoding benchmark's run (benchmarks/NOTES.md,
    "Where a step's time went that no kernel owned")."""
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    return HugePageArena(chunk_bytes=0).empty(shape, dtype).zero_()


def place_weights_on_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move the model's CPU weights of at least `min_bytes` onto 2 MB-aligned MADV_HUGEPAGE memory (see the module
    docstring): parameters (`.data`), buffers, the matrices of PackedWeights held as `module.packed` (one, or a
    list) and FP8 layers' `fp8_weight` / `fp8_scale`; a tensor reached twice (tied weights) is copied once. Call
    after `process_weights_after_loading`, before anything records data pointers (the C decode step). Returns the
    bytes moved (0 when not available); the model runner logs them with its KV caches' (`log_placement`)."""
    if not huge_pages_available():
        return 0
    arena = HugePageArena()
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def place(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < min_bytes:
            return t
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in copies:
            copy = copies[key] = arena.copy_of(t)
            copies[(copy.data_ptr(), copy.dtype, tuple(copy.shape))] = copy  # a tied weight met again
        return copies[key]

    with torch.no_grad():
        for module in model.modules():  # registration order: the layers in the order a step reads them
            for param in module.parameters(recurse=False):
                placed = place(param.data)
                if placed is not param.data:
                    param.data = placed
            for name, buf in list(module.named_buffers(recurse=False)):
                placed = place(buf)
                if placed is not buf:
                    setattr(module, name, placed)
            packed = getattr(module, "packed", None)
            for pw in packed if isinstance(packed, list) else [packed]:
                if isinstance(pw, PackedWeight):
                    pw.qweight, pw.scales, pw.mins = place(pw.qweight), place(pw.scales), place(pw.mins)
            if isinstance(getattr(module, "fp8_weight", None), torch.Tensor):  # Fp8LinearMethod's e4m3 matrix
                module.fp8_weight, module.fp8_scale = place(module.fp8_weight), place(module.fp8_scale)
    return arena.placed


def log_placement(weight_bytes: int, kv_cache_bytes: int) -> None:
    """Log in one INFO line what a model runner put on 2 MB-aligned memory advised MADV_HUGEPAGE: `weight_bytes` of
    weights (what place_weights_on_huge_pages returned) and `kv_cache_bytes` of KV caches; nothing when both are 0."""
    if weight_bytes or kv_cache_bytes:
        logger.info("weights %.1f MB and KV caches %.1f MB on 2 MB-aligned memory advised MADV_HUGEPAGE (transparent "
                    "huge pages)", weight_bytes / 1e6, kv_cache_bytes / 1e6)
