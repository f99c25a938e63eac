"""Handing back a thread's OpenMP worker pool (loom/kernels/openmp.py), and the engine thread's use of it.

Each case runs in a fresh interpreter: OpenMP pools are process state, and pytest's own process has its own.
A thread's workers are told apart by their thread ids: the ones a parallel region created.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task (Linux)")

_TIDS = """
import os
def tids():
    return set(os.listdir("/proc/self/task"))
"""


def _run(body: str) -> dict:
    code = textwrap.dedent(_TIDS) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_release_ends_the_calling_threads_workers():
    out = _run("""
        import json, torch
        from loom.kernels.openmp import loaded_runtimes, release_thread_pool
        torch.set_num_threads(2)
        before = tids()
        x = torch.randn(512, 512)
        for _ in range(3):
            x @ x  # MKL's GEMM opens a parallel region of 2 threads: the main thread's pool gets a worker
        workers = tids() - before
        released = release_thread_pool()
        print(json.dumps({"runtimes": loaded_runtimes(), "workers": sorted(workers), "released": released,
                          "left": sorted(workers & tids())}))
    """)
    assert any("omp" in path for path in out["runtimes"]), out
    assert out["workers"], "a 2-thread GEMM started no worker thread"
    assert out["released"] is True
    assert out["left"] == [], "the pool's workers outlived release_thread_pool()"


def test_release_without_a_pool_is_harmless_and_the_next_region_starts_a_new_one():
    out = _run("""
        import json, torch
        from loom.kernels.openmp import release_thread_pool
        torch.set_num_threads(2)
        first = release_thread_pool()  # nothing to hand back yet
        x = torch.randn(512, 512)
        y = x @ x
        again = release_thread_pool()
        before = tids()
        z = x @ x  # a new pool after the release, and the same product
        workers = tids() - before
        cached = release_thread_pool(rescan=False)  # the last scan's runtimes
        print(json.dumps({"first": first, "again": again, "same": bool(torch.equal(y, z)), "workers": sorted(workers),
                          "cached": cached, "left": sorted(workers & tids())}))
    """)
    assert out["again"] is True
    assert out["same"] is True
    assert out["workers"] and out["cached"] is True and out["left"] == []


def test_async_engine_start_hands_back_the_builders_workers(default_gguf):
    """The engine is built on the calling thread (its warm-up opens parallel regions there) and stepped on the
    engine thread; start() must end the builder's workers, in every loaded runtime (the bundled model's tokenizer
    loads sentencepiece, whose wheel carries a second libgomp): with two pools libgomp counts 3 threads on 2 CPUs
    and makes every barrier of a step sleep (benchmarks/NOTES.md, "Serving: two OpenMP pools")."""
    out = _run(f"""
        import json, torch
        from loom.config import EngineArgs
        from loom.engine.async_engine import AsyncLLMEngine
        from loom.engine.llm_engine import LLMEngine
        before = tids()
        engine = LLMEngine.from_engine_args(EngineArgs(model={str(default_gguf)!r}, num_threads=2, max_model_len=256))
        x = torch.randn(512, 512)
        x @ x  # the builder's pool, at 2 threads
        built = tids() - before
        front = AsyncLLMEngine(engine)
        front.start()
        left = built & tids()
        front.shutdown()
        print(json.dumps({{"built": sorted(built), "left": sorted(left)}}))
    """)
    assert out["built"], "building the engine started no thread"
    assert len(out["left"]) < len(out["built"]), f"start() left every worker of the builder's pool alive: {out}"


def test_building_an_engine_leaves_no_pool_on_the_building_thread(default_gguf):
    """LLMEngine hands back the pool its loading opened, so whichever thread steps it owns the only one (a user's
    worker thread as much as AsyncLLMEngine's). A region on the builder afterwards must start a new worker: with
    the old pool alive it would reuse that pool's worker and start none."""
    out = _run(f"""
        import json, torch
        from loom.config import EngineArgs
        from loom.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_args(EngineArgs(model={str(default_gguf)!r}, num_threads=2, max_model_len=256))
        before = tids()
        x = torch.randn(512, 512)
        x @ x
        print(json.dumps({{"new": sorted(tids() - before)}}))
    """)
    assert out["new"], "the building thread's pool outlived LLMEngine's construction"


def test_llm_hands_back_its_pool_when_a_call_returns(default_gguf):
    """Fresh-user trial: LLM warmed up on the main thread, then called from a worker thread (a web app's), slept at
    ~155 barriers a token, because the main thread's call left its pool alive. Each call now ends by handing it back:
    a region on the calling thread afterwards must start a new worker."""
    out = _run(f"""
        import json, torch
        from loom import LLM, SamplingParams
        llm = LLM(model={str(default_gguf)!r}, num_threads=2, max_model_len=256)
        first = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
        before = tids()
        x = torch.randn(512, 512)
        x @ x
        new = sorted(tids() - before)
        again = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
        print(json.dumps({{"new": new, "same": first[0].outputs[0].token_ids == again[0].outputs[0].token_ids}}))
    """)
    assert out["new"], "LLM.generate left the calling thread's pool alive"
    assert out["same"] is True
