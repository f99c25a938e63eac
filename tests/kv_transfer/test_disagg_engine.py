"""Prefill on one engine, decode on another through the TCP connector (tiny random Llama, float32): greedy output
identical to one co-located engine, every block back in both pools, and a fall back to local prefill on failure."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loom.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.sampling_params import SamplingParams
from tests.helpers import save_tiny_model

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("disagg") / "llama", "llama", hf_tokenizer))


def _engine(model: str, role: str | None = None, **kw: object) -> LLMEngine:
    args = dict(model=model, dtype="float32", block_size=BS, num_kv_blocks=96, kv_transfer_role=role)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def engines(tiny_llama: str):
    prefill, decode, colocated = _engine(tiny_llama, "producer"), _engine(tiny_llama, "consumer"), _engine(tiny_llama)
    yield prefill, decode, colocated
    prefill.shutdown()


def _prompts(hf_tokenizer) -> list[list[int]]:
    texts = ["The quick brown fox jumps over the lazy dog, and then", "def fibonacci(n):\n    return",
             "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", "Hi", "Write a haiku about the sea and the sky at dawn"]
    return [hf_tokenizer.encode(t) for t in texts]


def _run(engine: LLMEngine, max_steps: int = 2000) -> dict[str, object]:
    """Step until idle, checking the invariants after every step; the final RequestOutput of each request."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.check_invariants()
    raise AssertionError("no progress")


def _all_free(engine: LLMEngine) -> bool:
    engine.on_idle()
    engine.scheduler.check_invariants()
    stats = engine.get_stats()
    return stats.num_free_blocks == stats.num_blocks and stats.kv_transfer_pinned == 0


def _prefill(prefill: LLMEngine, prompts: list[list[int]]) -> list[dict]:
    for i, p in enumerate(prompts):
        prefill.add_request(f"p{i}", p, GREEDY.clone(), kv_transfer_params={"do_remote_decode": True})
    finals = _run(prefill)
    outs = [finals[f"p{i}"] for i in range(len(prompts))]
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # the prefill's part stops at the first token
    return [o.kv_transfer_params for o in outs]


def test_prefill_then_decode_equals_colocated_and_frees_every_block(engines, hf_tokenizer) -> None:
    prefill, decode, colocated = engines
    prompts = _prompts(hf_tokenizer)
    want = [colocated_tokens for colocated_tokens in _greedy(colocated, prompts)]
    params = _prefill(prefill, prompts)
    assert prefill.get_stats().kv_transfer_pinned == len(prompts)
    assert not _all_free(prefill)  # pinned until pulled
    for i, (p, kvp) in enumerate(zip(prompts, params)):
        assert kvp["do_remote_prefill"] and kvp["num_tokens"] == len(p)
        decode.add_request(f"d{i}", p, GREEDY.clone(), kv_transfer_params=kvp)
    finals = _run(decode)
    got = [list(finals[f"d{i}"].outputs[0].token_ids) for i in range(len(prompts))]
    assert got == want
    stats = decode.get_stats()
    pulled = [(len(p) - 1) // BS for p in prompts]
    assert stats.kv_transfer_blocks_loaded == sum(pulled) and stats.kv_transfer_pull_failures == 0
    assert stats.kv_transfer_pulls == sum(1 for n in pulled if n)
    assert _all_free(prefill) and _all_free(decode)


def _greedy(engine: LLMEngine, prompts: list[list[int]], prefix: str = "c") -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, GREEDY.clone())
    finals = _run(engine)
    return [list(finals[f"{prefix}{i}"].outputs[0].token_ids) for i in range(len(prompts))]


def test_chunked_decode_side_with_prefix_hits(tiny_llama: str, engines, hf_tokenizer) -> None:
    """The decode replica's own prefix-cache hits come first, the pulled blocks fill the rest, and a small token
    budget chunks what is left."""
    prefill, _, colocated = engines
    shared = hf_tokenizer.encode("A shared system prompt that spans a few blocks. " * 3)
    prompts = [shared + hf_tokenizer.encode(" First question?"), shared + hf_tokenizer.encode(" Another one, longer!")]
    want = _greedy(colocated, prompts, "h")
    decode = _engine(tiny_llama, "consumer", max_num_batched_tokens=8)
    decode.add_request("warm", shared[: 2 * BS + 1], SamplingParams(temperature=0.0, max_tokens=1))
    _run(decode)
    params = _prefill(prefill, prompts)
    for i, (p, kvp) in enumerate(zip(prompts, params)):
        decode.add_request(f"d{i}", p, GREEDY.clone(), kv_transfer_params=kvp)
    finals = _run(decode)
    assert [list(finals[f"d{i}"].outputs[0].token_ids) for i in range(2)] == want
    assert 0 < decode.get_stats().kv_transfer_blocks_loaded < sum((len(p) - 1) // BS for p in prompts)
    assert _all_free(prefill) and _all_free(decode)


def test_fallbacks_recompute_and_leak_nothing(tiny_llama: str, engines, hf_tokenizer) -> None:
    _, decode, colocated = engines
    prompts = _prompts(hf_tokenizer)[:2]
    want = _greedy(colocated, prompts, "f")
    failures = decode.get_stats().kv_transfer_pull_failures

    # the prefill replica is gone
    gone = _engine(tiny_llama, "producer")
    params = _prefill(gone, prompts)
    gone.shutdown()
    # the pinned blocks expire unread
    slow = _engine(tiny_llama, "producer", kv_transfer_timeout_s=0.2)
    expired = _prefill(slow, prompts)
    time.sleep(0.3)
    assert _all_free(slow) and slow.get_stats().kv_transfer_expired == 2
    # another block layout (block size 8 on the producer)
    other = _engine(tiny_llama, "producer", block_size=8)
    mismatched = _prefill(other, prompts)
    for tag, kvps in (("gone", params), ("expired", expired), ("layout", mismatched)):
        for i, (p, kvp) in enumerate(zip(prompts, kvps)):
            decode.add_request(f"{tag}{i}", p, GREEDY.clone(), kv_transfer_params=kvp)
        finals = _run(decode)
        assert [list(finals[f"{tag}{i}"].outputs[0].token_ids) for i in range(2)] == want, tag
    assert _all_free(other)  # the refused transfers were released, not left to the timeout
    # a different prompt than the one prefilled
    params = _prefill(slow, prompts)
    decode.add_request("swapped", prompts[1], GREEDY.clone(), kv_transfer_params=params[0])
    assert list(_run(decode)["swapped"].outputs[0].token_ids) == want[1]
    assert decode.get_stats().kv_transfer_pull_failures == failures + 7
    assert _all_free(decode)
    time.sleep(0.3)  # prompts[1]'s transfer was never asked for: the timeout frees it
    assert _all_free(slow)
    other.shutdown()
    slow.shutdown()


def test_roles_and_fields_are_checked(engines, hf_tokenizer) -> None:
    prefill, decode, colocated = engines
    prompt = _prompts(hf_tokenizer)[0]
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_decode needs a prefill replica"):
        decode.add_request("x", prompt, GREEDY.clone(), kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_prefill needs a decode replica"):
        colocated.add_request("x", prompt, GREEDY.clone(), kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(ValueError, match="kv_transfer_params"):
        prefill.add_request("x", prompt, SamplingParams(n=2, max_tokens=3),
                            kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="kv_transfer_params.block_ids"):
        decode.add_request("x", prompt, GREEDY.clone(), kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(ValueError, match="kv_transfer_role"):
        EngineArgs(kv_transfer_role="sideways").kv_transfer_config()
    assert not prefill.has_unfinished_requests() and not decode.has_unfinished_requests()


def test_real_model_prefill_then_decode_equals_colocated(default_gguf: Path, hf_tokenizer) -> None:
    """The bundled SmolLM2 (30 layers, 3 KV heads) in float32: P -> D greedy tokens equal one engine's."""
    kw = dict(block_size=16, num_kv_blocks=64)
    prefill = _engine(str(default_gguf), "producer", **kw)
    # no prefix cache on the decode side, so its own reference run leaves no hits and every full block is pulled
    decode = _engine(str(default_gguf), "consumer", enable_prefix_caching=False, **kw)
    try:
        prompts = [hf_tokenizer.encode("The capital of France is Paris. The capital of Spain is Madrid. The capital "
                                       "of Germany is Berlin. The capital of Italy is"),
                   hf_tokenizer.encode("def add(a, b):\n    \"\"\"Add two numbers and return the result.\"\"\"\n")]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for i, p in enumerate(prompts):  # the decode replica co-located (no transfer) is the reference
            decode.add_request(f"ref{i}", p, params.clone())
        finals = _run(decode)
        want = [list(finals[f"ref{i}"].outputs[0].token_ids) for i in range(len(prompts))]
        for i, p in enumerate(prompts):
            prefill.add_request(f"p{i}", p, params.clone(), kv_transfer_params={"do_remote_decode": True})
        outs = _run(prefill)
        for i, p in enumerate(prompts):
            decode.add_request(f"d{i}", p, params.clone(), kv_transfer_params=outs[f"p{i}"].kv_transfer_params)
        finals = _run(decode)
        assert [list(finals[f"d{i}"].outputs[0].token_ids) for i in range(len(prompts))] == want
        assert decode.get_stats().kv_transfer_blocks_loaded == sum((len(p) - 1) // 16 for p in prompts) > 0
        assert _all_free(prefill) and _all_free(decode)
    finally:
        prefill.shutdown()


def test_pins_never_take_more_than_half_the_pool(tiny_llama: str, hf_tokenizer) -> None:
    """Pinned blocks cannot be evicted: prefills whose decode replica never comes must not stall admission. Past
    half the pool a prefill is not pinned (no kv_transfer_params: its decode replica computes the prompt)."""
    engine = _engine(tiny_llama, "producer", num_kv_blocks=24, enable_prefix_caching=False)
    try:
        prompt = hf_tokenizer.encode("a prompt of some length that takes a few blocks of four tokens each here")
        blocks = -(-len(prompt) // BS)
        n = 24 // blocks + 2  # more than the whole pool could pin
        for i in range(n):
            engine.add_request(f"p{i}", prompt, GREEDY.clone(), kv_transfer_params={"do_remote_decode": True})
        finals = _run(engine)
        assert len(finals) == n  # every request finished: nothing stalled
        pinned = [f for f in finals.values() if f.kv_transfer_params]
        assert 1 <= len(pinned) and len(pinned) * blocks <= 12 < (len(pinned) + 1) * blocks
        assert engine.scheduler.pinned_kv.num_blocks() <= 12
    finally:
        engine.shutdown()
