"""Test helpers: the Hugging Face greedy oracle and tiny random-weight models."""

from __future__ import annotations

from pathlib import Path

import torch

@torch.inference_mode()
def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (never stopping at EOS) and log-softmax of each chosen token."""
    input_ids = torch.tensor([prompt_token_ids])
    past = None
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        # logits_to_keep=1: only the last position's logits are used, so the prefill skips the LM head on the rest
        # of the prompt (a 262k-vocabulary head over a 600-token prompt is most of a prefill's cost)
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(torch.argmax(lp))
        tokens.append(token)
        logprobs.append(float(lp[token]))
        input_ids = torch.tensor([[token]])
    return tokens, logprobs


def save_tiny_model(directory: Path, architecture: str, hf_tokenizer, seed: int = 0, **overrides: object) -> Path:
    """A 2-layer random-weight Llama, Qwen2, Qwen3, OLMo 2, Phi-3, Mixtral, Gemma 2 or Gemma 3 with the SmolLM2
    tokenizer, saved as safetensors (Qwen3's q/k norm weights random too, so that loading them is tested, not their
    all-ones initialization). Gemma's layer 0 slides over 8 tokens and layer 1 is global."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(
        vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif architecture == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, **common}))  # head_dim != hidden / heads, as Qwen3's
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif architecture == "mixtral":  # 4 experts, top 2; router weights scaled up so that routing varies by token
        model = MixtralForCausalLM(MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **common}))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(50.0)
    elif architecture == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint
        model = Phi3ForCausalLM(Phi3Config(**{"pad_token_id": 0, **common}))
    elif architecture in ("gemma2", "gemma3"):
        from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

        gemma = {"head_dim": 32, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                 "query_pre_attn_scalar": 24, "pad_token_id": 0, **common}
        if architecture == "gemma2":  # caps low enough to bite on random weights
            model = Gemma2ForCausalLM(Gemma2Config(**{"attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0,
                                                       **gemma}))
        else:
            model = Gemma3ForCausalLM(Gemma3TextConfig(**{"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **gemma}))
        with torch.no_grad():  # Gemma's norms scale by (1 + w) with w = 0 at initialization
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(-0.5, 0.5)
    elif architecture == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
        with torch.no_grad():  # the norms' all-ones initialization would not test their loading
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
    else:
        raise ValueError(architecture)
    model.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer.save_pretrained(directory)
    return directory


def run_engine_checked(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Drive an LLMEngine step by step over `prompts` (request ids "0", "1", ...), checking the scheduler's
    invariants after every step and that every KV block is back in the pool at the end; returns each
    request's output token ids in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 5000
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks  # every block is back in the pool
    return [results[str(i)] for i in range(len(prompts))]
