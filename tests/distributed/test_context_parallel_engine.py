"""Context parallelism in the engine: a prefill chunk split by position over two or three whole-model processes
(rank 0 in the test), against one process, in float32.

Each rank computes its share of every split chunk; the attention layers pass the chunks' K/V round the ring into
every rank's paged cache and attend with the engine's own backend, so greedy tokens must be equal and logprobs
within 1e-4 (the issue's bar for model parallelism). A rank that skipped the exchange would attend over keys it
never received and fail these comparisons. Each engine uses one thread per process.
"""

from __future__ import annotations

import pytest

import os

from loom import LLM, SamplingParams
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
# prompt logprobs read every prompt row (the gathered rows of every rank, in order); such requests skip the prefix
# cache, so they run apart from the prefix-hit test
PROMPT_LP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=2)
TEXTS = ["The quick brown fox", "def fibonacci(n):", "Bonjour, comment", "1, 2, 3, 4, 5,",
         "A long shared system prompt that fills several blocks. The quick brown fox " * 3,
         "A long shared system prompt that fills several blocks. def fibonacci(n): " * 3]

# uneven KV heads with biases (Llama); Gemma 2 with its sliding-window layer and logit soft-capping (the hybrid KV
# cache off: context parallelism refuses it)
TINY = {
    "llama": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=200,
                            attention_bias=True)),
    "gemma2": ("gemma2", {}),
    "mixtral": ("mixtral", {}),
    # LongRoPE switching to its long table at position 32 (head_dim 16: 8 factors each)
    "phi3_longrope": ("phi3", dict(original_max_position_embeddings=32, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.8 * i for i in range(8)]})),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp")
    return {name: str(save_tiny_model(root / name, arch, hf_tokenizer, **kw)) for name, (arch, kw) in TINY.items()}


def _run(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_close(want: list, got: list) -> None:
    for a, b in zip(want, got, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for la, lb, t in zip(x.logprobs, y.logprobs, x.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
        if a.prompt_logprobs is not None:
            for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                assert pa.keys() == pb.keys() and all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def _no_leak(llm: LLM) -> None:
    engine = llm.engine
    engine.scheduler.check_invariants()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(("name", "cp"), [("llama", 2), ("llama", 3), ("gemma2", 2)])
def test_context_parallel_equals_one_process_batched_with_prefix_hits_chunks_and_preemption(
        name: str, cp: int, tiny_dirs: dict[str, str], hf_tokenizer) -> None:
    """Small steps (chunked prefill: chunks split beside decode rows that run whole), few blocks (preemption), the
    same prompts twice (prefix hits: a split chunk after a cached prefix)."""
    prompts = [hf_tokenizer.encode(t) for t in TEXTS]
    common = dict(model=tiny_dirs[name], dtype="float32", num_threads=1, block_size=4, hybrid_kv_cache=False)
    want = _run(LLM(**common, num_kv_blocks=512), prompts)
    llm = LLM(**common, context_parallel_size=cp, num_kv_blocks=40, max_num_batched_tokens=24)
    try:
        for _ in range(2):
            _assert_close(want, _run(llm, prompts))
        _assert_close(_run(LLM(**common, num_kv_blocks=512), prompts[-2:], PROMPT_LP),
                      _run(llm, prompts[-2:], PROMPT_LP))
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert llm.engine.runner.context_parallel_steps > 0
        _no_leak(llm)
    finally:
        llm.engine.shutdown()


def test_context_parallel_with_ngram_speculation(tiny_dirs: dict[str, str], hf_tokenizer) -> None:
    """Verify rows run whole on every rank (their K/V land in every cache); the prompt is split."""
    prompts = [hf_tokenizer.encode("one two three one two three one two three one two")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    common = dict(model=tiny_dirs["llama"], dtype="float32", num_threads=1, speculative_method="ngram",
                  speculative_disable_by_batch_size=None)
    want = _run(LLM(**common), prompts, params)
    llm = LLM(**common, context_parallel_size=2)
    try:
        _assert_close(want, _run(llm, prompts, params))
        assert llm.engine.get_stats().spec_num_draft_tokens > 0
        assert llm.engine.runner.context_parallel_steps > 0
    finally:
        llm.engine.shutdown()


def test_a_later_turn_split_over_a_prefix_hit_on_generated_tokens(tiny_dirs: dict[str, str], hf_tokenizer) -> None:
    """Decode rows run whole on every rank: the workers' caches hold the generated tokens' K/V too, which the next
    turn's split chunk (a prefix hit over turn 1's prompt and output) attends to on every rank."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    turn1 = hf_tokenizer.encode("The quick brown fox jumps over the lazy dog. Tell me more:")
    follow_up = hf_tokenizer.encode(" And now a much longer follow-up question about foxes and dogs and their habits?")
    common = dict(model=tiny_dirs["llama"], dtype="float32", num_threads=1, block_size=4)

    def conversation(llm: LLM) -> list:
        first = _run(llm, [turn1], params)
        return first + _run(llm, [turn1 + list(first[0].outputs[0].token_ids) + follow_up], params)

    want = conversation(LLM(**common))
    llm = LLM(**common, context_parallel_size=2)
    try:
        _assert_close(want, conversation(llm))
        assert llm.engine.get_stats().prefix_cache_hits > 0 and llm.engine.runner.context_parallel_steps >= 2
    finally:
        llm.engine.shutdown()


def test_longrope_decides_a_split_chunk_by_its_last_token(tiny_dirs: dict[str, str], hf_tokenizer) -> None:
    """Phi-3's LongRoPE takes the long table for a chunk whose last token reaches position 32: a rank holding an
    early part of such a chunk must rotate it with the long table too (chunks of 24 tokens straddle 32)."""
    prompts = [hf_tokenizer.encode(t) for t in TEXTS[4:]]
    common = dict(model=tiny_dirs["phi3_longrope"], dtype="float32", num_threads=1, block_size=4,
                  max_num_batched_tokens=24)
    want = _run(LLM(**common), prompts)
    llm = LLM(**common, context_parallel_size=2)
    try:
        _assert_close(want, _run(llm, prompts))
        assert llm.engine.runner.context_parallel_steps > 0
    finally:
        llm.engine.shutdown()


def test_expert_routing_counts_include_every_rank_s_split_rows(tiny_dirs: dict[str, str], hf_tokenizer) -> None:
    """The MoE load metrics count each routed token once: rank 0's own rows plus the other ranks' split rows."""
    prompts = [hf_tokenizer.encode(t) for t in TEXTS]
    common = dict(model=tiny_dirs["mixtral"], dtype="float32", num_threads=1)
    one = LLM(**common)
    want = _run(one, prompts)
    llm = LLM(**common, context_parallel_size=2)
    try:
        _assert_close(want, _run(llm, prompts))
        assert llm.engine.runner.context_parallel_steps > 0
        assert llm.engine.get_stats().moe_expert_tokens == one.engine.get_stats().moe_expert_tokens
    finally:
        llm.engine.shutdown()


def test_real_model_context_parallel_equals_one_process(llm: LLM) -> None:
    """The bundled SmolLM2 in float32 (the oracle path), a long prompt and short ones in one step."""
    prompts = ["The capital of France is", "Write a haiku about autumn. " * 40, "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=1)
    want = llm.generate(prompts, params, use_tqdm=False)
    split = LLM(dtype="float32", quantization="none", num_threads=1, context_parallel_size=2)
    try:
        _assert_close(want, split.generate(prompts, params, use_tqdm=False))
        assert split.engine.runner.context_parallel_steps > 0
        _no_leak(split)
    finally:
        split.engine.shutdown()


def test_unsupported_context_parallel_setups_are_refused_by_name(tiny_dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="context_parallel_size must be an integer >= 1"):
        LLM(model=tiny_dirs["llama"], context_parallel_size=0)
    with pytest.raises(ValueError, match="context_parallel_size > 1 with tensor_parallel_size"):
        LLM(model=tiny_dirs["llama"], context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="context parallelism with a hybrid sliding-window KV cache"):
        LLM(model=tiny_dirs["gemma2"], dtype="float32", num_threads=1, context_parallel_size=2)


def test_ranks_whose_kv_caches_cannot_all_fit_this_machine_are_refused_before_any_starts(
        tiny_dirs: dict[str, str]) -> None:
    """Every context-parallel rank commits a whole KV cache: two caches of 0.6 of this machine's memory each are
    refused up front (the per-rank check would pass each alone), and no worker process is left."""
    physical_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    with pytest.raises(ValueError, match=r"2 ranks on this machine \(tensor 1 x pipeline 1 x context 2\) need about"):
        LLM(model=tiny_dirs["llama"], dtype="float32", num_threads=1, context_parallel_size=2,
            kv_cache_memory_gb=round(0.6 * physical_gib, 1))
    mine = str(os.getpid())
    children = [pid for pid in os.listdir("/proc") if pid.isdigit() and _parent(pid) == mine]
    assert not [pid for pid in children if "loom.executor.worker" in _cmdline(pid)]


def _parent(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[1]
    except OSError:  # gone meanwhile
        return ""


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_local_worker_leaves_when_rank_0_is_killed(tiny_dirs: dict[str, str], tmp_path) -> None:
    """Rank 0 killed after its worker is ready and before it opens the rendezvous, so no socket of the worker ever
    fails: the worker, in a session of its own, must notice it was re-parented and exit, not wait out the
    rendezvous timeout (300 s) as an orphan holding its memory. Started from a directory holding another `loom`
    package, it still imports rank 0's loom (a decoy that fails on import would stop it before "ready")."""
    import subprocess
    import sys
    import time

    decoy = tmp_path / "elsewhere" / "loom"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy loom was imported')\n")
    script = (f"import os, signal, sys; sys.path.insert(0, {os.getcwd()!r})\n"
              "import loom.executor.multiproc as multiproc\n"
              "from loom import LLM\n"
              "def die(*args, **kwargs):  # the workers are ready: report them, then vanish\n"
              "    mine = str(os.getpid())\n"
              "    kids = [p for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read()"
              ".rsplit(')', 1)[1].split()[1] == mine]\n"
              "    print(' '.join(kids), flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "multiproc.dist.init_process_group = die\n"
              f"LLM(model={tiny_dirs['llama']!r}, dtype='float32', num_threads=1, context_parallel_size=2)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path / "elsewhere")
    workers: list[str] = []
    try:
        workers = rank0.stdout.readline().split()
        rank0.wait(30)
        assert workers, "rank 0 died before its worker was ready"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "a worker outlived rank 0"
    finally:
        rank0.kill()
        for w in workers:
            if _alive(w):
                os.kill(int(w), 9)


def _alive(pid: str) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
