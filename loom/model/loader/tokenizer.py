"""Tokenizer (and chat template) of a model through transformers' AutoTokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_dir: Path) -> bool:
    """Whether a Hugging Face directory ships a tokenizer."""
    return any((model_dir / name).is_file() for name in _TOKENIZER_FILES)


def tokenizer_from_path(path: Path) -> Any:
    """Load the tokenizer of a GGUF file (vocab, merges and chat template from its metadata) or of a
    Hugging Face directory. Returns None for a directory without tokenizer files (random test models).
    """
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not has_tokenizer_files(path):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's own eos_token_id, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return set() if eos is None else {int(eos)}
