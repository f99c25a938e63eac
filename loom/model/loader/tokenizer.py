"""Tokenizer (and chat template) of a model through transformers' AutoTokenizer."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer

from loom.env import cache_root

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_dir: Path) -> bool:
    """Whether a Hugging Face directory ships a tokenizer."""
    return any((model_dir / name).is_file() for name in _TOKENIZER_FILES)


def tokenizer_from_path(path: Path) -> Any:
    """Load the tokenizer of a GGUF file (vocab, merges and chat template from its metadata) or of a
    Hugging Face directory. Returns None for a directory without tokenizer files (random test models).
    """
    if path.is_file():
        return _gguf_tokenizer(path)
    if not has_tokenizer_files(path):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's own eos_token_id, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return set() if eos is None else {int(eos)}


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept: $LOOM_CACHE_DIR/tokenizers, else ~/.cache/loom/tokenizers."""
    return cache_root() / "tokenizers"


def _gguf_tokenizer(path: Path) -> Any:
    """transformers rebuilds a fast tokenizer from the GGUF metadata (~7 s: it parses the file again).
    The result is saved once with save_pretrained and reloaded from there (well under a second) while
    the file (path, size, mtime) and the transformers version are unchanged."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError) as exc:  # a damaged cache entry: rebuild it
            logger.warning("ignoring tokenizer cache %s: %s", cached, exc)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        if cached.exists():  # another process won the race; keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cached)
    except OSError as exc:  # a read-only home is fine: we just convert every time
        logger.info("could not cache the tokenizer in %s: %s", cached, exc)
    return tokenizer
