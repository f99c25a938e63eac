"""loom.core is bookkeeping only: importing any of its modules must not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import importlib, pkgutil, sys
import loom.core
names = sorted(m.name for m in pkgutil.walk_packages(loom.core.__path__, "loom.core."))
for name in names:
    importlib.import_module(name)
assert {"loom.core.scheduler", "loom.core.kv_cache_manager", "loom.core.block_pool"} <= set(names), names
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(names), "modules;", "torch imported" if bad else "no torch")
sys.exit(1 if bad else 0)
"""


def test_core_modules_do_not_import_torch() -> None:
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no torch" in proc.stdout
