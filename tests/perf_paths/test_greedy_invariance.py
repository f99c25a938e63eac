"""Fast paths on vs off must not change fp32 greedy tokens (DESIGN.md, differential tests)."""

from __future__ import annotations

import pytest
import torch

from loom.model.layers import Linear, LMHead, UnquantizedLinearMethod
from loom.model.layers.linear import onednn_packing_available
from loom.model.loader import load_model
from tests.model.model_harness import PagedHarness, TinyModel

CPU = torch.device("cpu")
PROMPTS = {0: [5, 9, 11, 20, 31, 2, 7], 1: [40, 41], 2: [13, 14, 15, 16, 17, 18, 19, 21, 22, 23, 24]}


def _greedy(model: torch.nn.Module, arch: object, new_tokens: int) -> dict[int, list[int]]:
    """Greedy-decode every prompt together: request 2 is prefilled in two chunks while the others decode."""
    harness = PagedHarness(model, arch, block_size=4)
    out: dict[int, list[int]] = {r: [] for r in PROMPTS}
    first = harness.step({0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2][:5]})
    for r in (0, 1):
        out[r].append(int(first[r][-1].argmax()))
    second = harness.step({0: out[0][-1:], 1: out[1][-1:], 2: PROMPTS[2][5:]})
    for r in PROMPTS:
        out[r].append(int(second[r][-1].argmax()))
    for _ in range(new_tokens):
        logits = harness.step({r: out[r][-1:] for r in PROMPTS})
        for r in PROMPTS:
            out[r].append(int(logits[r][-1].argmax()))
    return out


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_llama3", "qwen2_gqa", "mistral_window"])
def test_cpu_paged_backend_keeps_greedy_tokens(tiny_models: dict[str, TinyModel], name: str) -> None:
    tokens = {}
    for backend in ("torch_reference", "cpu_paged"):
        loaded = load_model(str(tiny_models[name].path), torch.float32, CPU, attention_backend=backend)
        tokens[backend] = _greedy(loaded.model, loaded.arch, new_tokens=12)
    assert tokens["cpu_paged"] == tokens["torch_reference"]


def _unpack(model: torch.nn.Module) -> None:
    """Switch every linear layer and the LM head back to plain F.linear on the dense weights."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method = UnquantizedLinearMethod()
            module.packed_weight = None
        elif isinstance(module, LMHead):
            module.packed_weight = None
            module.gemv = None


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16, CPU), reason="CPU without native bf16")
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_gqa"])
def test_onednn_packed_bf16_linear_keeps_greedy_tokens(tiny_models: dict[str, TinyModel], name: str) -> None:
    """The default bf16 CPU linear path (oneDNN-packed weights, loom's GEMV for decode rows) keeps the greedy
    tokens of plain F.linear."""
    tokens = {}
    for packed in (True, False):
        loaded = load_model(str(tiny_models[name].path), torch.bfloat16, CPU)
        assert (loaded.model.lm_head.packed_weight is not None) is True
        if not packed:
            _unpack(loaded.model)
        tokens[packed] = _greedy(loaded.model, loaded.arch, new_tokens=12)
    assert tokens[True] == tokens[False]
