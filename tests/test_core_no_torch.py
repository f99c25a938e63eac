"""loom.core is bookkeeping only and loom.router a small front process: importing any of their modules must not
import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import importlib, pkgutil, sys
names = []
for package, expected in (("loom.core", {"scheduler", "kv_cache_manager", "block_pool"}),
                          ("loom.router", {"result_cache"})):
    found = sorted(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."))
    assert {f"{package}.{e}" for e in expected} <= set(found), found
    names += [n for n in found if not n.endswith(".__main__")]  # a __main__ runs a program when imported
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(names), "modules;", "torch imported" if bad else "no torch")
sys.exit(1 if bad else 0)
"""


def test_core_and_router_modules_do_not_import_torch() -> None:
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no torch" in proc.stdout
