"""Shared fixtures: the real bundled model (loom and the Hugging Face oracle) and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from loom.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf: Path):
    """transformers' own reading of the same GGUF, in float32: the numerical oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm(default_gguf: Path):
    """loom on the bundled model in float32, dequantized (the transformers-parity path), default engine options."""
    from loom import LLM

    return LLM(dtype="float32", quantization="none")
