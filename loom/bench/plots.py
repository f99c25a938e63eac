"""PNG figures of benchmark runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)

from loom.bench.metrics import tpot_seconds  # noqa: E402
from loom.bench.serve import RequestResult  # noqa: E402


def plot_serve(results: list[RequestResult], title: str, path: Path) -> Path:
    """Four panels: TTFT and TPOT per request over send time, ITL histogram, cumulative output tokens."""
    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.scatter([r.start_s for r in ok], [r.ttft_s * 1e3 for r in ok], s=8)
    ax.set(xlabel="send time (s)", ylabel="TTFT (ms)", title="TTFT per request")
    ax = axes[0][1]
    pts = [(r.start_s, t * 1e3) for r in ok if (t := tpot_seconds(r.e2e_s, r.ttft_s, r.output_tokens)) is not None]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, color="tab:orange")
    ax.set(xlabel="send time (s)", ylabel="TPOT (ms)", title="TPOT per request")
    ax = axes[1][0]
    itl = [g * 1e3 for r in ok for g in r.itl_s]
    ax.hist(itl or [0.0], bins=50, color="tab:green")
    ax.set(xlabel="ITL (ms)", ylabel="chunks", title="inter-token latency")
    ax = axes[1][1]
    ends = sorted((r.start_s + r.e2e_s, r.output_tokens) for r in ok)
    total, xs, ys = 0, [0.0], [0]
    for t, n in ends:
        total += n
        xs.append(t)
        ys.append(total)
    ax.step(xs, ys, where="post", color="tab:red")
    ax.set(xlabel="time (s)", ylabel="output tokens done", title="completed output tokens")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_bars(values: dict[str, float], ylabel: str, title: str, path: Path) -> Path:
    """One bar per named value (e.g. loom vs hf tokens/s), labelled with the value."""
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(values)
    bars = ax.bar(names, [values[n] for n in names], color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(names)])
    ax.bar_label(bars, fmt="%.3g")
    ax.set(ylabel=ylabel, title=title)
    fig.tight_layout()
    return _save(fig, path)


def plot_samples(samples: dict[str, list[float]], ylabel: str, title: str, path: Path) -> Path:
    """Box plot of repeated measurements (e.g. E2E latency of each run), one box per name."""
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(samples)
    ax.boxplot([samples[n] for n in names], tick_labels=names)
    ax.set(ylabel=ylabel, title=title)
    fig.tight_layout()
    return _save(fig, path)


def plot_longctx(rows: list[Any], title: str, path: Path) -> Path:
    """Accuracy (%) against KV budget, one panel per (task, length) that has rows, one line per policy.

    `rows` are loom.bench.longctx_run.LongCtxRow: x is each row's `budget_fraction` (KV tokens kept, or read per
    decode step for topk-blocks, over prompt tokens; log2 axis), y its accuracy; full attention is a dashed
    horizontal line at its accuracy."""
    cells = list(dict.fromkeys((r.task, r.length) for r in sorted(rows, key=lambda r: (r.task, r.length))))
    ncols = min(3, len(cells))
    nrows = -(-len(cells) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.8 * ncols, 3.1 * nrows + 0.5), squeeze=False, sharey=True)
    colors = {"full": "black", "sinks": "tab:blue", "h2o": "tab:orange", "snapkv": "tab:green",
              "topk-blocks": "tab:red"}
    fractions = [r.budget_fraction for r in rows if r.policy != "full"] or [0.25]
    ticks = [2.0**e for e in range(math.floor(math.log2(min(fractions))), 1)]
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for ax, (task, length) in zip(axes.flat, cells):
        cell = [r for r in rows if r.task == task and r.length == length]
        for policy in dict.fromkeys(r.policy for r in cell):
            pts = sorted((r.budget_fraction, 100 * r.accuracy) for r in cell if r.policy == policy)
            if policy == "full":
                ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=1, label="full attention")
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy, color=colors.get(policy))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"1/{round(1 / t)}" if t < 1 else "1" for t in ticks])
        ax.set_xlim(ticks[0] / 1.3, 1.3)
        ax.set_ylim(-5, 105)
        n = max(r.num_samples for r in cell)
        ax.set(title=f"{task}, {length} tokens (n={n})", xlabel="KV kept / prompt tokens")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("accuracy (%)")
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path)


def _save(fig: "plt.Figure", path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
