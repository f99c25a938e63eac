"""The reference implementations' own dequantization code, for the format tests: one Python module of a published
package, fetched once from PyPI with `pip download --no-deps`, checked against its SHA-256, cached under
loom's cache directory (`reference/`) and imported by path.

Neither package installs on a CPU-only machine with this torch (AutoGPTQ 0.7.1 ships CUDA builds; AutoAWQ 0.2.9
pins its own torch; BENCHMARKS.md, "Issue 12: RTN and GPTQ"), but each has a plain-torch path that its CPU users
run and that imports nothing beyond torch, numpy and transformers:

- AutoGPTQ 0.7.1, auto_gptq/nn_modules/qlinear/qlinear_cuda.py: `QuantLinear.forward` without the CUDA extension
  unpacks qweight / qzeros, applies v1's `zero + 1` and indexes scales and zeros by g_idx (act order included);
  `QuantLinear.pack` is its writer;
- AutoAWQ 0.2.9, awq/utils/packing_utils.py: `dequantize_gemm`, what `WQLinear_GEMM.forward` runs without its
  kernels (the gemm packing order, zeros, float16 scales; groups must divide the input size).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from loom.env import cache_root


@dataclass(frozen=True)
class ReferenceModule:
    requirement: str  # pip requirement, pinned
    pip_args: tuple[str, ...]  # what selects the archive
    member: str  # the module's path inside the archive
    sha256: str  # of the module's bytes: the code the tests execute is pinned, and a damaged cache is refetched


MODULES = {
    "auto_gptq_qlinear_cuda": ReferenceModule(
        "auto-gptq==0.7.1",
        ("--only-binary", ":all:", "--python-version", "3.11", "--platform", "manylinux2014_x86_64"),
        "auto_gptq/nn_modules/qlinear/qlinear_cuda.py",
        "5a6a483784adc7d9ee55e62f6dc4fdaf3a642f56796d2a6b8afea0b2364d751d",
    ),
    "autoawq_packing_utils": ReferenceModule(
        "autoawq==0.2.9", ("--no-binary", "autoawq"),  # an sdist only
        "autoawq-0.2.9/awq/utils/packing_utils.py",
        "65eab3eabe3f55e300ffbab5feac59c49322d985f42dcda4e2288859fb9a4abe",
    ),
}

_failures: dict[str, RuntimeError] = {}  # a failed fetch is not retried in the same process


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_member(archive: Path, member: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return z.read(member)
    with tarfile.open(archive) as t:
        f = t.extractfile(member)
        if f is None:
            raise KeyError(member)
        return f.read()


def _download(ref: ReferenceModule, timeout_s: float) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "10", "--retries", "1",
               "-d", tmp, *ref.pip_args, ref.requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"pip download {ref.requirement} took over {timeout_s} s") from e
        archives = sorted(Path(tmp).iterdir())
        if proc.returncode != 0 or len(archives) != 1:
            lines = proc.stderr.strip().splitlines()
            errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
            raise RuntimeError(f"pip download {ref.requirement} failed: {' '.join(errors)[:400]}")
        try:
            return _read_member(archives[0], ref.member)
        except (KeyError, OSError, tarfile.TarError, zipfile.BadZipFile) as e:
            raise RuntimeError(f"{ref.member} is not readable in {archives[0].name}: {e}") from e


def reference_module(name: str, timeout_s: float = 120.0) -> ModuleType:
    """Import one module of MODULES, downloading its package's archive when the cached copy is missing or is not
    the pinned file.

    Raises:
        RuntimeError: pip cannot download the archive (no network, no index, no pip), or the module in it is not
            the pinned file. Remembered: later calls in the process raise the same error at once.
    """
    if name in _failures:
        raise _failures[name]
    ref = MODULES[name]
    target = cache_root() / "reference" / ref.requirement.replace("==", "-") / Path(ref.member).name
    if not (target.exists() and _sha256(target.read_bytes()) == ref.sha256):
        try:
            data = _download(ref, timeout_s)
            if _sha256(data) != ref.sha256:
                raise RuntimeError(f"{ref.member} of {ref.requirement} is not the pinned file (SHA-256 "
                                   f"{_sha256(data)}, expected {ref.sha256})")
        except RuntimeError as e:
            _failures[name] = e
            raise
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")  # unique: concurrent fetches cannot collide
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    spec = importlib.util.spec_from_file_location(f"loom_reference_{name}", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
