"""loom's own compute kernels (C sources in csrc/, built on first use; see cpu.py)."""
