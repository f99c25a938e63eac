"""What a served model is, down to the bytes of its weights: the key a result cache and a router share.

Two servers with equal `ModelIdentity.digest` load the same weight bytes with the same quantization, activation
and KV-cache dtypes, tokenizer and chat template, so a deterministic request gets the same answer from either.
A name alone cannot say that (a re-quantized file keeps its name). Torch-free: the router reads identities from
the replicas' /v1/models cards and never computes one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loom.env import cache_root

# files of a Hugging Face model directory that can change what the model answers (weights, config, tokenizer,
# chat template); READMEs and images cannot
_DIRECTORY_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".gguf", ".bin", ".pt", ".pth")
_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The identity of one loaded model; `digest` is the one string to compare."""

    name: str  # the model's file or directory name (what /v1/models calls it without --served-model-name)
    weights_sha256: str  # sha256 over the checkpoint's bytes (weights_sha256 below), hex
    quantization: str  # the weight quantization method that runs ("gguf", "none", "w8a8", ...)
    dtype: str  # activation / dense-weight dtype, e.g. "float32"
    kv_cache_dtype: str  # the KV cache's element type, e.g. "float32", "fp8_e4m3"
    tokenizer_sha256: str  # sha256 over the tokenizer's vocabulary, special tokens and chat template, hex
    # what attention reads beyond exact dense attention: the engine's KV retention policy and block-sparse decode
    # settings (docs/long_context.md); "exact" = neither, every request sees every key
    attention: str = "exact"

    @property
    def digest(self) -> str:
        """sha256 (hex) of every field: equal digests, same model in the sense above."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def card(self) -> dict[str, str]:
        """The fields plus the digest, for the /v1/models card's `loom_model_identity`."""
        return {**asdict(self), "digest": self.digest}


def cache_dir() -> Path:
    """$LOOM_CACHE_DIR/model_identity, else ~/.cache/loom/model_identity (not created)."""
    return cache_root() / "model_identity"


def file_sha256(path: Path, use_cache: bool = True) -> str:
    """sha256 (hex) of a file's bytes. The result is remembered on disk under cache_dir(), keyed on the resolved
    path, size, mtime (ns) and inode, so a replaced or rewritten file is hashed again (a 100 MB GGUF: ~0.3 s).

    Raises:
        OSError: the file cannot be read.
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    memo = cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if use_cache:
        try:
            text = memo.read_text().strip()
            if len(text) == 64:
                return text
        except OSError:
            pass
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    value = digest.hexdigest()
    if use_cache:
        try:  # written whole then renamed: a reader never sees half a digest
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(value)
            tmp.replace(memo)
        except OSError:
            pass  # a read-only home: hash again next time
    return value


def weights_sha256(model_path: str | Path, use_cache: bool = True) -> str:
    """sha256 (hex) of a checkpoint: a GGUF file's bytes, or for a directory the sorted (relative path, file
    sha256) pairs of its weight, config, tokenizer and template files (_DIRECTORY_SUFFIXES, recursively).

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(model_path)
    if path.is_file():
        return file_sha256(path, use_cache)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _DIRECTORY_SUFFIXES)
    for p in files:
        digest.update(f"{p.relative_to(path).as_posix()}\0{file_sha256(p, use_cache)}\n".encode())
    return digest.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 (hex) of what the tokenizer turns a request into: its vocabulary (token -> id, sorted), special
    tokens and chat template. Works on any tokenizer with get_vocab(); missing parts hash as null."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    special = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "pad_token")}
    text = json.dumps([sorted(vocab.items()), special, getattr(tokenizer, "chat_template", None)],
                      ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = ["ModelIdentity", "cache_dir", "file_sha256", "weights_sha256", "tokenizer_sha256"]
