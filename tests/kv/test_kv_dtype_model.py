"""int8 / fp8 KV cache on the bundled SmolLM2-135M against a bfloat16 cache (model in float32).

int8 rows carry a float16 scale and minimum per 32 values (asymmetric); fp8 rows one float32 absmax scale per
(token slot, kv head) (loom.attention.kv_quant). The requirement for int8: greedy output equal to the 16-bit
cache on most prompts for 64 tokens, top-5 logprobs overlapping, about half the bytes per token.
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
    llm = LLM(dtype="float32", quantization="none", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.05)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return outs, llm.engine.kv_bytes_per_token


@pytest.fixture(scope="module")
def bf16_run() -> tuple[list[RequestOutput], int]:
    return _run("bfloat16")


# (dtype, bytes/token over bfloat16, min prompts identical for 64 tokens, min prompts identical for 8 tokens).
# int8: the requirement ("most prompts" = more than half). fp8: its teacher-forced top-1 flip rate of 2.7% per
# token (below) leaves 64 tokens unflipped with probability 0.973^64 = 17%, so about 1 prompt of 6 is expected
# identical (Zen 3 gave 4/6, a Sapphire Rapids-class CPU 1/6: float32 GEMMs round differently per CPU); fp8 is held
# to its first 8 tokens (0.973^8 = 80%: ~5 of 6) and to the top-5 overlap instead.
CASES = [("int8", 0.5625, 4, 5), ("fp8_e4m3", 0.53125, 0, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype,bytes_ratio,min_same,min_agree_8", CASES)
def test_quantized_cache_tracks_the_16_bit_cache(
    bf16_run, kv_cache_dtype: str, bytes_ratio: float, min_same: int, min_agree_8: int
) -> None:
    reference, ref_bytes = bf16_run
    outs, num_bytes = _run(kv_cache_dtype)
    assert num_bytes / ref_bytes == bytes_ratio  # about half: 1 byte per value + in-row scales
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
    # Measured (torch 2.13, cpu_paged backend, these 6 prompts): int8 4/6 identical for 64 tokens, 6/6 for 8,
    # top-5 overlap mean 4.93 min 4 (per-row absmax scales gave 1/6); fp8 4/6, 5/6, 4.81 min 4. On 24 prompts
    # int8 keeps 15/24 identical, but fp8 only 2/12 and its teacher-forced top-1 flip rate is 2.7% per token
    # (int8 0.59%), so the fp8 floor is set below this run's 4/6 (benchmarks/NOTES.md).
    print(kv_cache_dtype, f"identical {same}/6, first 8 identical {agree_8}/6,",
          f"top-5 overlap mean {sum(overlaps) / len(overlaps):.2f} min {min(overlaps)}")
    assert same >= min_same and agree_8 >= min_agree_8
    assert min(overlaps) >= 3 and sum(overlaps) / len(overlaps) >= 4.5
