"""int8 / fp8 KV cache on the bundled SmolLM2-135M against a bfloat16 cache (model in float32).

Rows are quantized with one absmax scale per (token slot, kv head) (loom.attention.kv_quant).
"""

from __future__ import annotations

import pytest

from loom import LLM, SamplingParams
from loom.outputs import RequestOutput

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "List three primary colors:",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=5)


def _run(kv_cache_dtype: str) -> tuple[list[RequestOutput], int]:
    llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.05)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return outs, llm.engine.kv_bytes_per_token


@pytest.fixture(scope="module")
def bf16_run() -> tuple[list[RequestOutput], int]:
    return _run("bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_tracks_the_16_bit_cache(bf16_run, kv_cache_dtype: str) -> None:
    reference, ref_bytes = bf16_run
    outs, num_bytes = _run(kv_cache_dtype)
    assert 0.5 < num_bytes / ref_bytes < 0.54  # about half: 1 byte per value + a float32 scale per 64
    same = agree_8 = 0
    overlaps: list[int] = []
    for got, want in zip(outs, reference, strict=True):
        got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
        same += got_ids == want_ids
        agree_8 += got_ids[:8] == want_ids[:8]
        for pos, (a, b) in enumerate(zip(got_ids, want_ids)):  # until the first divergence, same context
            top_got = {t for t, lp in got.outputs[0].logprobs[pos].items() if lp.rank <= 5}
            top_want = {t for t, lp in want.outputs[0].logprobs[pos].items() if lp.rank <= 5}
            overlaps.append(len(top_got & top_want))
            if a != b:
                break
    # Measured (torch 2.13, cpu_paged backend): int8 keeps 1/6 prompts identical for all 64 tokens and 5/6 for
    # the first 8, fp8 4/6 and 5/6; top-5 overlap >= 4 everywhere (mean 4.9 / 4.8). Near-ties in this 135M
    # model flip early: per-(token, head) absmax scales do not reach "identical on most prompts" for int8.
    print(kv_cache_dtype, f"identical {same}/6, first 8 identical {agree_8}/6,",
          f"top-5 overlap mean {sum(overlaps) / len(overlaps):.2f} min {min(overlaps)}")
    assert same >= 1 and agree_8 >= 4
    assert min(overlaps) >= 3 and sum(overlaps) / len(overlaps) >= 4.5
