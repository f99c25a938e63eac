"""TP=2 across two "machines" through torchrun: two network namespaces joined by a veth pair where this process may
make them (root), else two torchrun nodes on loopback. Node 0 runs `loom generate`, node 1 serves its steps; the
text must equal a single-process run's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GENERATE = ["-m", "loom.cli", "generate", "--dtype", "float32", "-q", "none", "--max-tokens", "16",
            "--temperature", "0", "--num-threads", "1", "The capital of France is"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes() -> Iterator[tuple[list[list[str]], str]]:
    """([command prefix of node 0, of node 1], master address)."""
    ns = [f"loom{os.getpid()}a", f"loom{os.getpid()}b"]
    veth = [f"lv{os.getpid() % 100000}a", f"lv{os.getpid() % 100000}b"]
    made: list[str] = []
    try:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise PermissionError("network namespaces need root and iproute2")
        for name in ns:
            _run(["ip", "netns", "add", name])
            made.append(name)
        _run(["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]])
        for i, (name, dev) in enumerate(zip(ns, veth, strict=True)):
            _run(["ip", "link", "set", dev, "netns", name])
            _run(["ip", "-n", name, "addr", "add", f"10.78.0.{i + 1}/24", "dev", dev])
            _run(["ip", "-n", name, "link", "set", dev, "up"])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        prefixes = [["ip", "netns", "exec", name, "env", f"GLOO_SOCKET_IFNAME={dev}"]
                    for name, dev in zip(ns, veth, strict=True)]
        yield prefixes, "10.78.0.1"
    except (PermissionError, subprocess.CalledProcessError):
        yield [["env", "GLOO_SOCKET_IFNAME=lo"]] * 2, "127.0.0.1"  # two nodes on loopback
    finally:
        for name in made:  # deleting a namespace deletes the veth end inside it, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_tp2_across_two_torchrun_nodes_equals_one_process(two_nodes: tuple[list[list[str]], str]) -> None:
    prefixes, master = two_nodes
    print(f"nodes joined through {'a veth pair between two network namespaces' if master != '127.0.0.1' else 'loopback'}")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", master, "--master-port", str(_free_port())]
    nodes = [subprocess.Popen([*prefix, *torchrun, "--node-rank", str(rank), *GENERATE, "--tensor-parallel-size",
                               "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, prefix in enumerate(prefixes)]
    outs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, err[-3000:]
    single = subprocess.run([sys.executable, *GENERATE], capture_output=True, text=True, timeout=240, check=True)
    assert outs[0][0].strip() and outs[0][0] == single.stdout
    assert "tensor 2 x pipeline 1 x context 1 = 2 ranks on gloo (torchrun)" in outs[0][1]
    assert outs[1][0] == ""  # the worker node prints nothing of its own
