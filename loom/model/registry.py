"""Architecture name (as in a Hugging Face config's `architectures`) -> model class."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from loom.model.llama import (Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Olmo2ForCausalLM,
                              OlmoeForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,
                              Qwen3MoeForCausalLM)

# Read-only: a new architecture adds an entry here.
MODEL_REGISTRY: Mapping[str, type[LlamaForCausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Olmo2ForCausalLM": Olmo2ForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "OlmoeForCausalLM": OlmoeForCausalLM,
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
    }
)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Model class for an architecture name.

    Raises:
        ValueError: the architecture is not supported (the message lists those that are).
    """
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return cls
