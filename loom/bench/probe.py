"""Short torch probes of the machine's achievable memory bandwidth and matmul rate.

Both are "achievable" figures (what torch reaches on this machine with these threads), not vendor peaks:
the roofline floors built on them are floors for a torch engine here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class MachineSpec:
    bandwidth: float  # BW, achievable memory bandwidth, bytes/s
    flops: float  # F, achievable dense matmul rate in the compute dtype, FLOP/s
    dtype: str  # dtype the matmul rate was measured in
    threads: int  # torch intra-op threads used by the probe
    source: str  # "probe" or "given"

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.flops <= 0:
            raise ValueError(f"flops must be > 0 FLOP/s, got {self.flops}")

    @property
    def ridge(self) -> float:
        """Ridge point R = F / BW, FLOP per byte (roofline model, Williams et al. 2009)."""
        return self.flops / self.bandwidth


def measure_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-`repeats` copy bandwidth in bytes/s: dst.copy_(src) moves 2·num_bytes (read + write).

    The buffer (default 256 MiB) is far larger than any CPU cache, so this is DRAM bandwidth.
    """
    if num_bytes < 1 << 20:
        raise ValueError(f"num_bytes must be >= 1 MiB, got {num_bytes}")
    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # page in both buffers before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def measure_matmul_flops(dtype: str = "float32", size: int = 1024, min_seconds: float = 0.5) -> float:
    """Best dense matmul rate in FLOP/s for square [size, size] @ [size, size] in `dtype` (2·size³ FLOP each).

    Raises:
        ValueError: unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    a = torch.randn(size, size).to(DTYPES[dtype])
    b = torch.randn(size, size).to(DTYPES[dtype])
    torch.mm(a, b)  # warm up kernels and thread pool
    best = float("inf")
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def probe_machine(dtype: str = "float32", threads: int | None = None) -> MachineSpec:
    """Measure bandwidth and matmul rate (about 1-2 s). `threads` None keeps torch's current setting."""
    old = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        bw = measure_bandwidth()
        flops = measure_matmul_flops(dtype)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    return MachineSpec(bandwidth=bw, flops=flops, dtype=dtype, threads=used, source="probe")
