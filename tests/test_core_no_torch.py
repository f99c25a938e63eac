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


_CLI_SCRIPT = """
import sys
from loom.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("exit", code, "torch imported" if bad else "no torch")
"""


def test_cli_help_and_argument_errors_do_not_import_torch() -> None:
    """`loom --help`, every subcommand's --help, a malformed argument, `loom serve`'s own checks of its address,
    engine or sampling values the engine would refuse and checkpoint paths that are not there are answered before
    torch is imported: importing torch and the engine first took ~3 s (6-11 s on a busy machine) against ~0.6 s."""
    repo = Path(__file__).resolve().parents[1]
    helps = [[], ["generate"], ["chat"], ["serve"], ["router"], ["quantize"], ["analyze"], ["bench"],
             *(["bench", b] for b in ("latency", "throughput", "serve", "prefix", "quality", "quant", "longctx"))]
    cases = [([*h, "--help"], 0) for h in helps] + [
        (["serve", "--port", "abc"], 2), (["bench", "latency", "--input-len", "x"], 2),
        (["serve", "--port", "99999"], 2),  # refused by the command itself, before its engine loads
        (["serve", "--host", "999.0.0.1"], 2),
        # an engine or sampling value the engine would refuse, refused before it loads
        (["bench", "latency", "--num-threads", "0"], 2), (["generate", "hi", "--max-tokens", "-5"], 2),
        (["chat", "--temperature", "-1"], 2),
        # a checkpoint path that is not there (or a directory without config.json), before anything loads
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], 2), (["serve", "--model", str(repo / "docs")], 2),
        (["analyze", "--model", "/nonexistent"], 2), (["quantize", "--model", "/nonexistent", "--output", "/tmp/x"], 2),
        # loom quantize's option and output checks
        (["quantize", "--method", "fp8", "--bits", "4", "--output", "/tmp/x"], 2),
        (["quantize", "--method", "rtn", "--output", str(repo / "README.md")], 2)]
    for argv, code in cases:
        proc = subprocess.run([sys.executable, "-c", _CLI_SCRIPT, *argv], cwd=repo, capture_output=True, text=True,
                              timeout=60)
        assert f"exit {code} no torch" in proc.stdout, (argv, proc.stdout[-500:], proc.stderr[-500:])
