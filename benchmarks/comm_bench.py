"""gloo all-reduce, all-gather and send/recv time against message size on loopback, and the α-β model fitted to it.

Two processes (one torch thread each) join a gloo group over tcp://127.0.0.1. After --warmup operations per size,
--reps rounds each visit every size once in a shuffled order (so other load on the machine spreads over all sizes): a
barrier, then a burst of --burst back-to-back operations (the burst keeps the barrier's exit skew out of all but
the first). The figure is the median over rounds of a burst's time per operation, on rank 0. send/recv is a
ping-pong (rank 0 sends, rank 1 sends back): one-way time = round trip / 2.

Sizes: what a step of the bundled model sends at TP=2 (all-reduce and send of 576 x float32 x 1..512 tokens,
all-gather of 1..16 rows of 24,576 float32 logits per rank), plus a sweep of n = 1 KiB .. 16 MiB per operation (n:
the reduced tensor, the gathered output, the message).

Fit: time = c_op·α + b_op(n)/BW with the coefficients of loom/bench/comm.py's formulas at p = 2, least squares on
relative residuals (each row divided by its measured time, because the target is a relative error), once jointly
over all operations and once per operation. Writes a JSON that `loom analyze --interconnect loopback --link-profile`
reads, and prints measured against predicted.

    .venv/bin/python benchmarks/comm_bench.py [--out benchmarks/results/comm_loopback.json] [--reps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.bench.comm import Interconnect, OpLink, all_gather_time, all_reduce_time, send_time

HIDDEN = 576  # bundled SmolLM2-135M
VOCAB_PER_RANK = 24576  # its 49,152-token vocab over 2 ranks
FLOAT_BYTES = 4
RANKS = 2
MEASURED_OPS = ("all_reduce", "all_gather", "send")


@dataclass(frozen=True, slots=True)
class Point:
    op: str  # "all_reduce", "all_gather" or "send"
    num_bytes: int  # the formula's n: the reduced tensor, the gathered output, the message; bytes
    per_rank_bytes: int  # each rank's input tensor, bytes
    step_size: bool  # a size a step of the bundled model sends at TP=2
    median_s: float  # median over repetitions of one operation's time, seconds
    p10_s: float  # 10th percentile, seconds
    p90_s: float  # 90th percentile, seconds

    def time(self, statistic: str) -> float:
        """The measured time the fit and the errors use: "median" or "p10" (the time when neither process was
        descheduled during the operation), seconds."""
        return self.median_s if statistic == "median" else self.p10_s


def sizes() -> list[tuple[str, int, bool]]:
    """(op, per-rank bytes, step size?) for every measurement."""
    tokens = [1 << i for i in range(10)]  # 1 .. 512
    rows = [1, 2, 4, 8, 16]
    sweep = [1024 << i for i in range(15)]  # 1 KiB .. 16 MiB
    out = [("all_reduce", t * HIDDEN * FLOAT_BYTES, True) for t in tokens]
    out += [("send", t * HIDDEN * FLOAT_BYTES, True) for t in tokens]
    out += [("all_gather", r * VOCAB_PER_RANK * FLOAT_BYTES, True) for r in rows]
    out += [(op, s // RANKS if op == "all_gather" else s, False) for op in MEASURED_OPS for s in sweep]  # n = s
    return out


def _one_op(op: str, rank: int, x: torch.Tensor, parts: list[torch.Tensor]) -> None:
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":
        dist.all_gather(parts, x)
    elif rank == 0:  # ping-pong
        dist.send(x, 1)
        dist.recv(x, 1)
    else:
        dist.recv(x, 0)
        dist.send(x, 0)


def _worker(rank: int, port: int, reps: int, warmup: int, burst: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    plan = sizes()
    bufs = []
    for op, per_rank, _ in plan:
        x = torch.ones(per_rank // FLOAT_BYTES, dtype=torch.float32)
        bufs.append((x, [torch.empty_like(x) for _ in range(RANKS)]))
    for (op, _, _), (x, parts) in zip(plan, bufs, strict=True):
        for _ in range(warmup):
            _one_op(op, rank, x, parts)
    times: list[list[float]] = [[] for _ in plan]
    order = random.Random(0)  # the same seed on both ranks: they must visit the sizes in the same order
    # every round visits every size, so a burst of other load on the machine spreads over all sizes, in a shuffled
    # order, so that no size always follows the 16 MiB messages (the first size of a fixed order ran slower)
    for _ in range(reps):
        visit = list(range(len(plan)))
        order.shuffle(visit)
        for i in visit:
            (op, _, _), (x, parts) = plan[i], bufs[i]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(burst):
                _one_op(op, rank, x, parts)
            per_op = (time.perf_counter() - t0) / burst
            times[i].append(per_op / 2 if op == "send" else per_op)  # a ping-pong is two one-way messages
    if rank == 0:
        results = []
        for (op, per_rank, step), ts in zip(plan, times, strict=True):
            q = statistics.quantiles(ts, n=10)
            n = per_rank * RANKS if op == "all_gather" else per_rank
            results.append(Point(op, n, per_rank, step, statistics.median(ts), q[0], q[-1]))
        queue.put([asdict(p) for p in results])
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(reps: int, warmup: int, burst: int) -> list[Point]:
    """Run the two ranks; rank 0's points."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, reps, warmup, burst, queue)) for r in range(RANKS)]
    for p in procs:
        p.start()
    points = [Point(**d) for d in queue.get(timeout=3600)]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return points


def coefficients(op: str, n: float) -> tuple[float, float]:
    """(c, b) of time = c·α + b/BW for loom/bench/comm.py's formula of `op` at p = 2."""
    p = RANKS
    if op == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p * n
    if op == "all_gather":
        return p - 1, (p - 1) / p * n
    return 1.0, n


def fit(points: list[Point], statistic: str = "median") -> tuple[float, float]:
    """(α s, BW bytes/s) minimising Σ ((c·α + b/BW - t) / t)² over `points` (t: each point's `statistic`), both kept
    >= 0.

    A parameter the unconstrained solution makes negative is fixed at 0 and the other refitted.
    """
    a = np.array([coefficients(p.op, p.num_bytes) for p in points], dtype=np.float64)
    t = np.array([p.time(statistic) for p in points], dtype=np.float64)
    w = (a / t[:, None], np.ones_like(t))
    sol, *_ = np.linalg.lstsq(w[0], w[1], rcond=None)
    lat, inv_bw = float(sol[0]), float(sol[1])
    if lat < 0:
        lat, inv_bw = 0.0, float(np.dot(w[0][:, 1], w[1]) / np.dot(w[0][:, 1], w[0][:, 1]))
    elif inv_bw <= 0:
        lat, inv_bw = float(np.dot(w[0][:, 0], w[1]) / np.dot(w[0][:, 0], w[0][:, 0])), 1e-30
    return lat, 1.0 / inv_bw


def predict(link: Interconnect, p: Point) -> float:
    """The model's time for p, seconds (through loom/bench/comm.py, the code loom analyze runs)."""
    if p.op == "all_reduce":
        return all_reduce_time(p.num_bytes, RANKS, link)
    if p.op == "all_gather":
        return all_gather_time(p.num_bytes, RANKS, link)
    return send_time(p.num_bytes, link)


def report(points: list[Point], joint: Interconnect, per_op: Interconnect,
           statistic: str = "median") -> tuple[str, dict[str, float]]:
    """Markdown table of measured (`statistic`) against both models, and the worst relative errors."""
    lines = [f"| op | bytes (n) | step size | measured {statistic} us (p10-p90) | joint fit us | err | per-op fit us | "
             "err |", "|---|---|---|---|---|---|---|---|"]
    worst = {"joint_step": 0.0, "joint_all": 0.0, "per_op_step": 0.0, "per_op_all": 0.0}
    for p in sorted(points, key=lambda q: (q.op, q.num_bytes, not q.step_size)):
        pj, pp = predict(joint, p), predict(per_op, p)
        ej, ep = pj / p.time(statistic) - 1, pp / p.time(statistic) - 1
        worst["joint_all"] = max(worst["joint_all"], abs(ej))
        worst["per_op_all"] = max(worst["per_op_all"], abs(ep))
        if p.step_size:
            worst["joint_step"] = max(worst["joint_step"], abs(ej))
            worst["per_op_step"] = max(worst["per_op_step"], abs(ep))
        lines.append(f"| {p.op} | {p.num_bytes:,} | {'yes' if p.step_size else ''} | {p.time(statistic) * 1e6:,.1f} "
                     f"({p.p10_s * 1e6:,.0f}-{p.p90_s * 1e6:,.0f}) | {pj * 1e6:,.1f} | {100 * ej:+.0f}% | "
                     f"{pp * 1e6:,.1f} | {100 * ep:+.0f}% |")
    return "\n".join(lines), worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/comm_loopback.json"))
    ap.add_argument("--reps", type=int, default=25, help="timed repetitions per size (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed operations per size (default: %(default)s)")
    ap.add_argument("--burst", type=int, default=4, help="operations per repetition (default: %(default)s)")
    ap.add_argument("--statistic", choices=("median", "p10"), default="median",
                    help="which measured time the model is fitted to and judged against: the median over "
                         "repetitions, or the 10th percentile (an operation neither process was descheduled in) "
                         "(default: %(default)s)")
    ap.add_argument("--against", type=Path, default=None,
                    help="an earlier run's JSON: also print its per-op fit's errors on this run (out of sample) and "
                         "this run's measured times over its, at the step sizes (how reproducible they are)")
    ns = ap.parse_args()
    if ns.reps < 20 or ns.burst < 1 or ns.warmup < 0:
        raise ValueError("--reps must be >= 20, --burst >= 1 and --warmup >= 0")
    earlier = None
    if ns.against is not None:  # read and checked before the minute of measuring
        earlier = json.loads(ns.against.read_text())
        theirs = earlier.get("settings", {}).get("statistic", "median")  # files before --statistic: medians
        if theirs != ns.statistic:
            raise ValueError(f"--against {ns.against} was fitted to the {theirs}; judge it with --statistic {theirs}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_before = os.getloadavg()
    points = measure(ns.reps, ns.warmup, ns.burst)
    load_after = os.getloadavg()
    lat, bw = fit(points, ns.statistic)
    joint = Interconnect("loopback joint fit", bw, lat)
    op_fits = {op: fit([p for p in points if p.op == op], ns.statistic) for op in MEASURED_OPS}
    per_op = Interconnect("loopback per-op fit", bw, lat, tuple(OpLink(op, b, a) for op, (a, b) in op_fits.items()))
    table, worst = report(points, joint, per_op, ns.statistic)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    doc = {
        "started": started, "machine": {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
                                        "torch": torch.__version__},
        "settings": {"ranks": RANKS, "reps": ns.reps, "warmup": ns.warmup, "burst": ns.burst, "backend": "gloo",
                     "init": "tcp://127.0.0.1", "threads_per_rank": 1, "statistic": ns.statistic},
        "loadavg_1_5_15": {"before": load_before, "after": load_after},  # other work on the cores skews the times
        "fit": {"joint": {"latency_s": lat, "bandwidth_Bps": bw},
                "per_op": {op: {"latency_s": a, "bandwidth_Bps": b} for op, (a, b) in op_fits.items()}},
        "worst_relative_error": worst,
        "points": [asdict(p) for p in points],
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=2))
    print(f"joint fit: latency {lat * 1e6:.1f} us, bandwidth {bw / 1e9:.3f} GB/s")
    for op, (a, b) in op_fits.items():
        print(f"{op} fit: latency {a * 1e6:.1f} us, bandwidth {b / 1e9:.3f} GB/s")
    print(table)
    print("worst |relative error|: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in worst.items()))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); wrote {ns.out}")
    if earlier is not None:
        print(against(points, earlier, ns.statistic))


def against(points: list[Point], earlier: dict, statistic: str) -> str:
    """Lines: an earlier run's per-op fit judged on this run's `statistic` at the step sizes (out of sample), and this
    run's measured times over the earlier run's at each step size (the measurement's own reproducibility)."""
    fits = earlier["fit"]["per_op"]
    joint = earlier["fit"]["joint"]
    link = Interconnect("earlier per-op fit", joint["bandwidth_Bps"], joint["latency_s"],
                        tuple(OpLink(op, f["bandwidth_Bps"], f["latency_s"]) for op, f in fits.items()))
    before = {(p["op"], p["num_bytes"]): Point(**p) for p in earlier["points"]}
    lines = []
    for op in MEASURED_OPS:
        step = [p for p in points if p.op == op and p.step_size]
        errors = [predict(link, p) / p.time(statistic) - 1 for p in step]
        ratios = [p.time(statistic) / before[(p.op, p.num_bytes)].time(statistic) for p in step
                  if (p.op, p.num_bytes) in before]
        lines.append(f"{op}: earlier fit's error on this run {' '.join(f'{100 * e:+.0f}%' for e in errors)} "
                     f"(worst {100 * max(abs(e) for e in errors):.0f}%); this run / earlier run "
                     f"{' '.join(f'{r:.2f}' for r in ratios)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
