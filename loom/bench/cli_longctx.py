"""`loom bench longctx` command line (torch is imported only when the command runs)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from loom.bench.longctx import PROMPT_FORMATS, TASKS
from loom.engine.arg_utils import at_least

POLICY_CHOICES = ("full", "sinks", "h2o", "snapkv", "topk-blocks")


def register_longctx(bench_sub: argparse._SubParsersAction) -> None:
    """Add `loom bench longctx` to the `loom bench` subcommands."""
    from loom.engine.arg_utils import add_engine_args

    p = bench_sub.add_parser(
        "longctx", help="long-context retrieval (passkey, multi-document QA): accuracy, KV bytes, decode tok/s and "
                        "TTFT per KV retention policy and budget vs full attention")
    g = p.add_argument_group("long-context workload")
    g.add_argument("--lengths", type=at_least(1), nargs="+", default=[2048, 4096, 8192],
                   help="prompt tokens; one at the context limit is cut to leave room for --max-tokens "
                        "(default: %(default)s)")
    g.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="(default: %(default)s)")
    g.add_argument("--num-samples", type=at_least(1), nargs="+", default=[10],
                   help="samples per (task, length): one value, or one per --lengths entry (default: %(default)s)")
    g.add_argument("--policies", nargs="+", choices=POLICY_CHOICES, default=list(POLICY_CHOICES),
                   help="KV policies; full always runs first; topk-blocks runs in an engine of its own per top-k "
                        "(default: %(default)s)")
    g.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5],
                   help="retention budgets: <= 1 a fraction of the prompt, > 1 tokens (default: %(default)s)")
    g.add_argument("--sparse-topk", type=at_least(1), nargs="+", default=None,
                   help="top-k values of topk-blocks (default: for each length and budget, the k whose blocks read, "
                        "with the sink and recent ones, are that fraction of the prompt)")
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat-prefill",
                   help="chat-prefill: chat template with the answer's first words written; chat: chat template; "
                        "raw: no template (default: %(default)s)")
    g.add_argument("--max-tokens", type=at_least(1), default=12,
                   help="generated tokens per request, greedy (default: %(default)s)")
    g.add_argument("--num-docs", type=at_least(1), default=4, help="multidoc: documents (default: %(default)s)")
    g.add_argument("--num-keys", type=at_least(1), default=4,
                   help="multidoc: key-value needles (default: %(default)s)")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the samples (default: %(default)s)")
    g.add_argument("--output-json", type=Path, default=None,
                   help="result file (default: benchmarks/results/longctx-<model>-<time>.json)")
    g.add_argument("--plot", type=Path, default=None, help="PNG of accuracy against KV budget")
    g.add_argument("--verbose", action="store_true", help="print each request's answer as it finishes")
    g.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="JSON",
                   help="run nothing: merge the rows of earlier --output-json files of one model, print the table "
                        "and --plot")
    add_engine_args(p)
    p.set_defaults(func=cmd_longctx)


def _samples_per_length(ns: argparse.Namespace) -> dict[int, int]:
    if len(ns.num_samples) not in (1, len(ns.lengths)):
        raise ValueError(f"--num-samples takes one value or one per --lengths entry ({len(ns.lengths)}), got "
                         f"{len(ns.num_samples)}")
    counts = ns.num_samples * len(ns.lengths) if len(ns.num_samples) == 1 else ns.num_samples
    return dict(zip(ns.lengths, counts))


def cmd_longctx(ns: argparse.Namespace) -> int:
    """Build the samples, run full attention then each policy and budget, print the table, write JSON (and PNG)."""
    from loom.bench.cli import result_path
    from loom.bench.longctx import AustenProse, build_samples
    from loom.bench.longctx_run import (
        LOSSY_POLICIES, format_table, run_policies, run_sparse_in_process, topk_for_fraction, warm_up,
    )  # fmt: skip
    from loom.bench.metrics import machine_info, write_json
    from loom.core.kv_retention import check_budget
    from loom.engine.arg_utils import engine_args_from_namespace
    from loom.engine.llm_engine import LLMEngine

    if ns.from_json is not None:
        return _replot(ns)
    for b in ns.budgets:
        check_budget(b, "--budgets")
    counts = _samples_per_length(ns)
    args = engine_args_from_namespace(ns)
    if args.kv_retention != "full" or args.sparse_attention != "none":
        raise ValueError("--kv-retention / --sparse-attention: longctx sets them per request and per engine itself "
                         "(--policies, --budgets, --sparse-topk); leave them at full / none")
    started = time.perf_counter()
    engine = LLMEngine(args)
    workload = {}
    try:  # the novels are read when first used
        prose = AustenProse(engine.tokenizer)
        for task in ns.tasks:
            for length in ns.lengths:
                n = min(length, engine.max_model_len - ns.max_tokens)
                workload[(task, length)] = build_samples(prose, task, n, counts[length], ns.dataset_seed,
                                                         ns.prompt_format, ns.num_docs, ns.num_keys)
    except RuntimeError as exc:  # the held-out text cannot be had: a one-line error, no traceback
        message = str(exc).replace(", or pass --text-file", "")  # longctx has no --text-file
        raise ValueError(f"--tasks: {message}") from exc
    warm_up(engine)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if ns.verbose else None
    rows = run_policies(engine, args, workload, ns.policies, ns.budgets, ns.max_tokens, log)
    model_name = engine.model_name
    block = engine.block_size
    sink_blocks, recent = args.sparse_attention_sink_blocks, args.sparse_attention_recent_blocks
    engine.shutdown()
    del engine
    if "topk-blocks" in ns.policies:
        plan: dict[int, dict] = {}
        for (task, length), samples in workload.items():
            ks = ns.sparse_topk or [topk_for_fraction(b, samples[0].num_tokens, block, sink_blocks, recent)
                                    for b in ns.budgets if b <= 1]
            for k in ks:
                plan.setdefault(k, {})[(task, length)] = samples
        for k, part in sorted(plan.items()):
            rows += run_sparse_in_process(args, part, k, ns.max_tokens)
    order = {p: i for i, p in enumerate(POLICY_CHOICES)}
    rows.sort(key=lambda r: (r.task, r.length, order[r.policy], r.budget or 0.0))
    label = Path(model_name).stem
    print(f"model {model_name}, prompt format {ns.prompt_format}, max_tokens {ns.max_tokens}, "
          f"lossy policies {[p for p in ns.policies if p in LOSSY_POLICIES]}, {time.perf_counter() - started:.0f} s")
    print(format_table(rows))
    path = ns.output_json or result_path(Path("benchmarks/results"), "longctx", label, "json")
    write_json(path, {"model": model_name, "machine": machine_info(), "argv": sys.argv[1:],
                      "prompt_format": ns.prompt_format, "max_tokens": ns.max_tokens, "dataset_seed": ns.dataset_seed,
                      "engine_args": dataclasses.asdict(args), "rows": [dataclasses.asdict(r) for r in rows]})
    print(f"wrote {path}")
    if ns.plot is not None:
        from loom.bench.plots import plot_longctx

        print(f"wrote {plot_longctx(rows, f'{label}: retrieval accuracy vs KV budget', ns.plot)}")
    return 0


def _replot(ns: argparse.Namespace) -> int:
    """--from-json: the rows of earlier runs (a (task, length, policy, budget) seen twice keeps the first file's)."""
    import json

    from loom.bench.longctx_run import LongCtxRow, format_table

    rows, seen, models = [], set(), []
    for path in ns.from_json:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--from-json: cannot read {path}: {exc}") from exc
        models.append(str(data.get("model")))
        for d in data["rows"]:
            key = (d["task"], d["length"], d["policy"], d["budget"])
            if key not in seen:
                seen.add(key)
                rows.append(LongCtxRow(**d))
    order = {p: i for i, p in enumerate(POLICY_CHOICES)}
    rows.sort(key=lambda r: (r.task, r.length, order[r.policy], r.budget or 0.0))
    print(format_table(rows))
    if ns.plot is not None:
        from loom.bench.plots import plot_longctx

        label = ", ".join(dict.fromkeys(Path(m).stem for m in models))
        print(f"wrote {plot_longctx(rows, f'{label}: retrieval accuracy vs KV budget', ns.plot)}")
    return 0


__all__ = ["cmd_longctx", "register_longctx"]
