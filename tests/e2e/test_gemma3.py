"""Gemma-3-270M, the real GGUF: loom's greedy tokens equal transformers' in float32 (its local layers slide over
512 tokens, so one prompt is longer than the window), and the packed model runs from the file's own blocks."""

from __future__ import annotations

import pytest

from loom import LLM, SamplingParams
from tests.helpers import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Bonjour ! Comment ça va ? 日本語も少し話せます。",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef softmax(x):",
]
NEW_TOKENS = 16  # greedy tokens per prompt: enough for a divergence to show (each costs a step of all four models)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma_prompts(gemma3_gguf) -> list[list[int]]:
    from loom.model.loader.tokenizer import tokenizer_from_path

    tokenizer = tokenizer_from_path(gemma3_gguf)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # one prompt past the 512-token window of the local layers, so that the window and the global layers both act
    long = tokenizer.encode(" ".join(f"Item {i} is {'red' if i % 3 else 'blue'}." for i in range(120)))
    assert len(long) > 600
    prompts[-1] = long + prompts[-1][1:]
    return prompts


@pytest.fixture(scope="module")
def gemma_reference(gemma3_gguf, gemma_prompts) -> list[tuple[list[int], list[float]]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32)
    with torch.no_grad():
        return [hf_greedy(hf.eval(), ids, NEW_TOKENS) for ids in gemma_prompts]


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers(gemma3_gguf, gemma_prompts, gemma_reference) -> None:
    llm = LLM(model=str(gemma3_gguf), dtype="float32", quantization="none", block_size=16)
    outputs = llm.generate(gemma_prompts, GREEDY, use_tqdm=False)
    for out, (ref_tokens, ref_logprobs) in zip(outputs, gemma_reference, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        got = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
        assert got == pytest.approx(ref_logprobs, abs=1e-3)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    # the hybrid KV cache: 6 groups of 3 layers (3 global, 15 sliding); the long prompt's sliding groups let go of
    # the blocks behind their 512-token window
    assert len(llm.engine.runner.kv_groups) == 6 and llm.engine.scheduler.num_window_blocks_freed > 0
    # a base model has no chat template: a conversation is refused by name, not with transformers' own error
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_gemma3_270m_packed_hybrid_equals_one_table(gemma3_gguf, gemma_prompts, gemma_reference) -> None:
    """The file's own blocks (the default `gguf` method, the one-call C decode step): the hybrid KV cache gives the
    same greedy tokens as one block table for every layer, and agrees with transformers' float32 tokens on most
    positions (quantized weights: agreement reported, not identity demanded)."""
    outs = []
    for hybrid in (True, False):
        llm = LLM(model=str(gemma3_gguf), hybrid_kv_cache=hybrid)
        assert llm.engine.runner.model.model.decode_step is not None
        outs.append([o.outputs[0].token_ids for o in llm.generate(gemma_prompts, GREEDY, use_tqdm=False)])
    assert outs[0] == outs[1]
    same = sum(a == b for out, (ref, _) in zip(outs[0], gemma_reference) for a, b in zip(out, ref))
    assert same / (len(gemma_prompts) * NEW_TOKENS) > 0.5
