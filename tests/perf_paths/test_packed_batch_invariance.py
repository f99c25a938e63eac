"""The bundled model at its default packed weights gives a request the same bits alone, in a batch and on a
prefix-cache hit, where the q4g matmuls are interleaved (avx512_vnni: one summation order at every row count)
and decode attention splits keys by the request's own length (csrc/paged_decode.c). Before, the row count of a
step chose the matmul path and the batch chose the key split, and int16 activation codes turned last-bit
differences into different sampled tokens (benchmarks/NOTES.md, "Packed weights are not batch-invariant")."""

from __future__ import annotations

import pytest
import torch

from loom import LLM, SamplingParams
from loom.quant.methods import quant_kernels

pytestmark = pytest.mark.skipif(
    "q4gr16" not in quant_kernels(torch.device("cpu")).interleaved_layouts,
    reason="q4g runs the row-count-dependent tiles / dequantization here (no avx512_vnni build)")

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters. ")


def _logprobs(out) -> list[float]:
    return [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def test_a_request_gets_the_same_bits_alone_in_a_batch_and_on_a_cache_hit() -> None:
    llm = LLM(num_threads=2)
    prompts = [f"Note {i}: " + TEXT[: 60 + 80 * i] for i in range(6)]  # ~20 to ~110 tokens: some keys split
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=20, logprobs=1, ignore_eos=True)
              for i in range(6)]
    batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]  # a prefix-cache hit of the batch's run
        assert alone.token_ids == batch[i].token_ids, i
        assert _logprobs(alone) == _logprobs(batch[i]), i
    long = "Summary: " + TEXT * 2  # ~150 tokens: more than the tiles' 128 rows when fresh
    greedy = SamplingParams(temperature=0, max_tokens=3, logprobs=5)
    fresh, hit = (llm.generate([long], greedy, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert fresh.token_ids == hit.token_ids
    for a, b in zip(fresh.logprobs, hit.logprobs, strict=True):
        assert {t: v.logprob for t, v in a.items()} == {t: v.logprob for t, v in b.items()}
