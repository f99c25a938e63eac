"""`loom router` flags: defaults that parse into a RouterConfig, refusals that name the flag, and a router
process that never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import build_parser, main
from loom.router.cli import router_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_make_a_router_config() -> None:
    ns = build_parser().parse_args(["router", "--replica", "http://127.0.0.1:8001"])
    config = router_config(ns)
    assert config.policy == "cache_aware" and config.policy_options.cache_threshold == 0.5
    ns = build_parser().parse_args(["router", "--replica", "http://h:1", "--policy", "least_load",
                                    "--model-selector", "difficulty", "--model-selector-option", "threshold=0.3"])
    assert router_config(ns).model_selector_options == {"threshold": "0.3"}


@pytest.mark.parametrize("argv, flag", [
    (["router"], "--replica"),
    (["router", "--replica", "ftp://h:1"], "--replica"),
    (["router", "--replica", "http://h:1", "--policy", "random"], "--policy"),
    (["router", "--replica", "http://h:1", "--cache-threshold", "2"], "--cache-threshold"),
    (["router", "--replica", "http://h:1", "--max-attempts", "0"], "--max-attempts"),
    (["router", "--replica", "http://h:1", "--model-selector", "length", "--model-selector-option", "nokey"],
     "--model-selector-option"),
    (["router", "--replica", "http://h:1", "--model-selector-option", "threshold=1"], "--model-selector-option"),
    (["router", "--replica", "http://127.0.0.1:99999"], "--replica"),
    (["router", "--replica", "http://127.0.0.1:8001/v1"], "--replica"),
    (["router", "--replica", "http://h:1", "--host", "999.1.1.1"], "--host"),
    (["router", "--replica", "http://h:1", "--health-interval", "0"], "--health-interval"),
    (["router", "--replica", "http://h:1", "--result-cache-ttl", "0"], "--result-cache-ttl"),
    (["router", "--replicas", "2", "--", "--port", "9000"], "serve_args"),
    (["router", "--replica", "http://h:1", "--", "--num-threads", "1"], "serve_args"),
])
def test_bad_flags_are_refused_naming_the_flag(argv: list[str], flag: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_router_process_never_imports_torch() -> None:
    script = ("import sys, pkgutil, importlib, loom.router\n"
              "for m in pkgutil.walk_packages(loom.router.__path__, 'loom.router.'):\n"
              "    if m.name != 'loom.router.__main__': importlib.import_module(m.name)\n"
              "from loom.router.cli import main\n"
              "try:\n    main(['--replica', 'http://127.0.0.1:1', '--port', '-1'])\n"
              "except SystemExit as e:\n    assert e.code == 2\n"
              "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
              "print('torch' if bad else 'no torch')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("no torch"), proc.stdout + proc.stderr


def test_sigterm_stops_the_router_through_its_cleanup() -> None:
    """uvicorn re-raises SIGTERM after its shutdown; the router must still run its `finally` (which stops the
    local replicas it started) and exit 0."""
    import signal
    import time

    import httpx

    from tests.server.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loom.router", "--port", str(port), "--replica",
                             "http://127.0.0.1:9"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, "the router did not start"
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "router stopped" in err
