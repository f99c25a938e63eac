"""Hugging Face transformers as the peer backend of the offline benchmarks.

The same checkpoint (transformers dequantizes a GGUF to the requested dtype), greedy decoding, exactly the
requested number of new tokens (min_new_tokens = max_new_tokens), static batches with left padding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from loom.bench.datasets import SampleRequest, load_bench_tokenizer
from loom.bench.probe import DTYPES


class TimingStreamer(BaseStreamer):
    """Records perf_counter() at each generate() step; the first put() is the prompt, the rest new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []  # seconds (perf_counter) of each put(), prompt first

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFRunner:
    """An AutoModelForCausalLM and its tokenizer (None for token-id-only use), loaded once."""

    def __init__(self, model: Any, tokenizer: Any, pad_token_id: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id  # token id used for left padding

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is tokenized without added special tokens, as the engine does)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids: this HFRunner has no tokenizer")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    @torch.inference_mode()
    def generate_timed(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        """Greedy-generate exactly `output_len` tokens for one prompt. Returns (TTFT s, E2E s)."""
        ids = torch.tensor([prompt])
        streamer = TimingStreamer()
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                            min_new_tokens=output_len, do_sample=False, streamer=streamer,
                            pad_token_id=self.pad_token_id)
        end = time.perf_counter()
        first = streamer.times[1] if len(streamer.times) > 1 else end
        return first - start, end - start

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        """One static batch, left-padded; every row gets exactly `output_len` new tokens (greedy)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                  do_sample=False, pad_token_id=self.pad_token_id)
        return [row[width:].tolist() for row in out]


def load_hf_runner(model: str | None, dtype: str) -> HFRunner:
    """transformers model + tokenizer of a GGUF file (dequantized) or HF directory; None = bundled default."""
    from loom.model.loader import default_model_path

    path = default_model_path() if model is None else Path(model)
    kwargs: dict[str, Any] = {"dtype": DTYPES["float32" if dtype == "auto" else dtype]}
    if path.is_file():
        hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    tokenizer = load_bench_tokenizer(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFRunner(hf_model, tokenizer, int(pad or 0))


def hf_throughput(runner: HFRunner, requests: list[SampleRequest], batch_size: int) -> tuple[float, int, int]:
    """Run `requests` in arrival order as static batches of `batch_size`.

    A batch generates until its longest requested output; only each request's own expected_output_len
    counts as output (the rest is the cost of static batching). Returns (elapsed s, input tokens, output tokens).

    Raises:
        ValueError: batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {batch_size}")
    prompts = [runner.prompt_ids(r.prompt) for r in requests]
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        runner.generate_batch(prompts[i:i + batch_size], max(r.expected_output_len for r in batch))
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(p) for p in prompts), sum(r.expected_output_len for r in requests)
