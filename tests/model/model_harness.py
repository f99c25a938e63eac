"""Test helpers: tiny random HF checkpoints, and a driver that runs a loom model over a paged cache."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from loom.attention import build_attention_metadata
from loom.model.arch import ModelArchConfig
from loom.worker.kv_cache import allocate_kv_caches


VOCAB = 97  # vocabulary of the tiny test models


@dataclass
class TinyModel:
    name: str  # key of TINY_CONFIGS
    path: Path  # HF directory with config.json and model.safetensors
    hf: torch.nn.Module  # the transformers model (fp32, eval), the oracle


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter O(1)-ish random values so mistakes show up well above fp32 noise
    (HF's default 0.02 init makes logits nearly flat)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.3 * noise / max(1.0, param.shape[-1] ** 0.5 / 4))


def save_tiny_model(config: PretrainedConfig, out_dir: Path, seed: int, **save_kwargs: object) -> torch.nn.Module:
    """Build a random AutoModelForCausalLM from `config`, save it as safetensors, return it (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out_dir, **save_kwargs)
    return model.eval()


@dataclass
class PagedHarness:
    """Runs steps of a loom model for several requests, allocating KV blocks as a scheduler would
    (deliberately out of order, so block tables are not contiguous)."""

    model: torch.nn.Module
    arch: ModelArchConfig
    block_size: int
    num_blocks: int = 64
    seed: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request -> tokens already computed
    tables: dict[int, list[int]] = field(default_factory=dict)  # request -> block ids

    def __post_init__(self) -> None:
        self.caches = allocate_kv_caches(self.arch, self.num_blocks, self.block_size, torch.float32, torch.device("cpu"))
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute `chunks[r]` as the next tokens of request r; returns r -> logits [len, vocab] fp32."""
        query_lens, seq_lens, tables, input_ids, positions = [], [], [], [], []
        for req, new in chunks.items():
            done = self.tokens.setdefault(req, [])
            table = self.tables.setdefault(req, [])
            seq_len = len(done) + len(new)
            while len(table) * self.block_size < seq_len:
                table.append(self.free.pop())
            query_lens.append(len(new))
            seq_lens.append(seq_len)
            tables.append(list(table))
            input_ids += new
            positions += range(len(done), seq_len)
            done += new
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, torch.device("cpu"))
        meta.check_invariants()
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for req, q_len in zip(chunks, query_lens):
            out[req] = logits[start : start + q_len]
            start += q_len
        return out


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """HF logits [len, vocab] float32 of one sequence, computed from scratch."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
