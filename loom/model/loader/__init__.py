"""Checkpoint loading: GGUF files and Hugging Face model directories."""

from __future__ import annotations

from loom.model.arch import ModelArchConfig
from loom.model.loader.default import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path
from loom.model.loader.model_loader import (
    LoadedModel,
    load_model,
    load_tokenizer,
    read_arch,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "LoadedModel",
    "ModelArchConfig",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "read_arch",
    "resolve_model_path",
]
