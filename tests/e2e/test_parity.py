"""Reference parity: loom's greedy tokens equal transformers' on the same weights, alone and batched."""

from __future__ import annotations

import pytest

from loom import SamplingParams
from tests.helpers import hf_greedy, save_tiny_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The quick brown fox",
    "Translate to German: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "Explain photosynthesis in one sentence.",
    "Bonjour ! Comment ça va ? 日本語も少し話せます。",
    "Once upon a time, in a land far away, there lived a",
]
NEW_TOKENS = 32


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    # Half raw text, half through the chat template: different lengths and token mixes.
    return [
        _chat_ids(hf_tokenizer, p) if i % 2 else hf_tokenizer.encode(p) for i, p in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def reference(hf_gguf_model, prompt_ids) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(hf_gguf_model, ids, NEW_TOKENS) for ids in prompt_ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def _check(outputs, reference, tol: float = 1e-3) -> None:
    for out, (ref_tokens, ref_logprobs) in zip(outputs, reference):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        got = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
        assert got == pytest.approx(ref_logprobs, abs=tol)


def test_gguf_greedy_one_by_one_matches_transformers(llm, prompt_ids, reference) -> None:
    outputs = [llm.generate([ids], GREEDY, use_tqdm=False)[0] for ids in prompt_ids]
    _check(outputs, reference)


def test_gguf_greedy_batched_matches_transformers(llm, prompt_ids, reference) -> None:
    _check(llm.generate(prompt_ids, GREEDY, use_tqdm=False), reference)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "olmo2", "phi3", "mixtral", "gemma2", "gemma3"])
def test_tiny_random_safetensors_match_transformers(tmp_path, hf_tokenizer, architecture: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from loom import LLM

    directory = save_tiny_model(tmp_path / architecture, architecture, hf_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # 4 prompts sharing a 12-token prefix (prefix caching has something to hit), 32 new tokens each
    shared = hf_tokenizer.encode("You are a helpful assistant. Answer briefly and well.")[:12]
    prompts = [shared + hf_tokenizer.encode(p) for p in PROMPTS[:4]]
    reference = [hf_greedy(hf, ids, 32) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    alone = LLM(model=str(directory), dtype="float32", block_size=4, num_kv_blocks=256)
    _check([alone.generate([ids], params, use_tqdm=False)[0] for ids in prompts], reference, tol=1e-4)
    # batched, with chunked prefill (8 tokens a step) and too few KV blocks for all four: preemption
    tight = LLM(model=str(directory), dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    _check(tight.generate(prompts, params, use_tqdm=False), reference, tol=1e-4)
    stats = tight.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks
    assert alone.engine.get_stats().prefix_cache_hits > 0  # the later prompts reused the shared prefix


def test_phi3_longrope_matches_transformers(tmp_path, hf_tokenizer) -> None:
    """Phi-3's LongRoPE (128k models): short factors below original_max_position_embeddings (32 here), long ones
    from there, cos/sin scaled by sqrt(1 + ln(512 / 32) / ln 32). Two short prompts decode across position 32
    (transformers switches tables at that step; cached keys keep their rotation), two prompts start past it.
    Greedy tokens equal transformers' and logprobs within 1e-4, alone and batched."""
    import torch
    from transformers import AutoModelForCausalLM

    from loom import LLM

    head_dim = 64 // 4
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
               "long_factor": [1.5 + 0.8 * i for i in range(head_dim // 2)]}
    directory = save_tiny_model(tmp_path / "phi3_longrope", "phi3", hf_tokenizer, rope_scaling=scaling,
                                original_max_position_embeddings=32)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    short = [hf_tokenizer.encode(p) for p in PROMPTS[:2]]
    long = [hf_tokenizer.encode(" ".join(PROMPTS[i : i + 4])) for i in (2, 4)]
    assert all(len(p) < 32 for p in short) and all(len(p) > 32 for p in long)
    prompts = short + long
    reference = [hf_greedy(hf, ids, 32) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(directory), dtype="float32", block_size=4)
    assert llm.engine.runner.model.model.rotary_emb.long_from == 32
    _check([llm.generate([ids], params, use_tqdm=False)[0] for ids in prompts], reference, tol=1e-4)
    _check(llm.generate(prompts, params, use_tqdm=False), reference, tol=1e-4)
