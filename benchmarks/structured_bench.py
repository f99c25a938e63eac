"""Structured-output overhead: decode step time with and without a JSON-schema constraint, grammar compile time.

    .venv/bin/python benchmarks/structured_bench.py [--batch 1 16] [--steps 48] [--repeats 3]

Each configuration runs in the same process, alternated (constrained, plain, constrained, ...): a batch of B
chat requests (the same person-as-JSON prompt), greedy, `--steps` decode steps after the prefill step. With a
constraint every row also gets an llguidance mask and the sampler's -inf fill. Reported: median decode step
(ms), its ratio, the mean time of StructuredOutputManager.bitmask per row, and the compile time of the 12
schemas of tests/e2e/test_structured_output.py with a cold cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

from loom import LLM, SamplingParams
from loom.sampling_params import StructuredOutputParams as SO

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 200},
                                           "biography": {"type": "string", "maxLength": 2000}},
          "required": ["name", "biography"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Write a long biography of a famous scientist, as JSON."}]


def decode_steps(llm: LLM, batch: int, steps: int, constrained: bool) -> list[float]:
    engine = llm.engine
    spec = SO(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, structured_output=spec)
    prompt = engine.apply_chat_template(ASK)
    for i in range(batch):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", list(prompt), params)
    times = []
    engine.step()  # prefill (prefix-cached after the first run)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    llm = LLM(max_num_seqs=max(ns.batch))
    manager = llm.engine.structured
    calls: list[float] = []
    original = manager.bitmask

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        calls.append(time.perf_counter() - t0)
        return out

    manager.bitmask = timed
    for batch in ns.batch:
        results: dict[bool, list[float]] = {True: [], False: []}
        decode_steps(llm, batch, 4, True)  # warm-up: tokenizer wrap, kernels
        decode_steps(llm, batch, 4, False)
        calls.clear()
        for _ in range(ns.repeats):
            for constrained in (True, False):
                results[constrained] += decode_steps(llm, batch, ns.steps, constrained)
        on, off = statistics.median(results[True]), statistics.median(results[False])
        print(f"batch {batch}: decode step median {1e3 * on:.2f} ms constrained vs {1e3 * off:.2f} ms plain "
              f"({on / off:.3f}x); bitmask {1e6 * statistics.mean(calls):.0f} us per row over {len(calls)} rows")
    import tests.e2e.test_structured_output as t

    from loom.sample.structured import StructuredOutputManager

    cold = StructuredOutputManager(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids)
    cold.compile(SO(json_object=True))  # the tokenizer wrap, once per engine
    t0 = time.perf_counter()
    for schema in t.SCHEMAS:
        cold.compile(SO(json=schema))
    print(f"compile: {1e3 * (time.perf_counter() - t0) / len(t.SCHEMAS):.2f} ms per schema (12 schemas, cold cache)")


if __name__ == "__main__":
    main()
