"""A frequency-ranked draft vocabulary: the draft model's LM head computes the logits of the most frequent tokens only.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling"): a small draft model with a large vocabulary spends much of its step in the LM head (Qwen2.5-Coder-0.5B's
151,936 x 896 head is over a third of the bytes it reads per token at 4-bit layers), while the tokens it drafts come
almost all from a small, frequent part of the vocabulary. Restricting the draft's head to the `size` most frequent
tokens of a corpus cuts that share in proportion; a token outside the set can no longer be drafted, which costs
acceptance, never a wrong token: the target verifies every draft over its full vocabulary (loom/spec/verify.py).

Frequencies are counted on a text corpus with the draft's tokenizer: by default the Python standard library's own
source (code, docstrings and comments; present wherever loom runs), or the files a user names. The counts are cached
under $LOOM_CACHE_DIR (default ~/.cache/loom)/draft_vocab, keyed by the tokenizer's vocabulary and the corpus files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from loom.env import cache_root
from loom.quant.layout import INTERLEAVED, interleavable, interleave_rows16

logger = logging.getLogger(__name__)

# standard-library directories left out of the default corpus: test suites (fixtures, binary-like data) and tools
_SKIPPED_STDLIB_PARTS = frozenset({"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3"})
_CORPUS_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")


def default_corpus() -> list[Path]:
    """The Python standard library's .py files (tests and site-packages left out), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if not _SKIPPED_STDLIB_PARTS.intersection(p.relative_to(root).parts[:-1])]


def corpus_files(corpus: str | None) -> list[Path]:
    """The files of `corpus`: None = default_corpus(); a file; or a directory (its .py/.txt/.md/.rst/.json/.jsonl
    files, recursively, sorted).

    Raises:
        ValueError: the path does not exist, or holds no such file.
    """
    if corpus is None:
        return default_corpus()
    path = Path(corpus)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"speculative_draft_vocab_corpus {corpus!r} is neither a file nor a directory")
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in _CORPUS_SUFFIXES]
    if not files:
        raise ValueError(f"speculative_draft_vocab_corpus {corpus!r} holds no {'/'.join(_CORPUS_SUFFIXES)} file")
    return files


# Text is read and tokenized in pieces of about this many characters (a fast tokenizer holds ~120 bytes of memory per
# character of a batch: a 125 MB file read whole took 19 GB), and at most MAX_CORPUS_CHARS of a corpus is counted.
PIECE_CHARS = 1 << 20
MAX_CORPUS_CHARS = 32 << 20  # ~25 s of tokenizing on two cores; the stdlib source is 11 M


def _pieces(files: list[Path], limit: int) -> Iterator[str]:
    """The files' text in pieces of about PIECE_CHARS characters (a full piece runs on to the end of its line), at
    most `limit` characters in all."""
    left = limit
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as handle:
            while left > 0:
                piece = handle.read(min(PIECE_CHARS, left))
                if not piece:
                    break
                if len(piece) == PIECE_CHARS:  # finish the line, so a token is rarely cut in two
                    piece += handle.readline()
                left -= len(piece)
                yield piece
        if left <= 0:
            return


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if callable(tokenizer):  # a transformers tokenizer: one batched call (its Rust backend, ~1M tokens/s)
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [list(tokenizer.encode(t)) for t in texts]


def _cache_path(tokenizer: Any, files: list[Path]) -> Path:
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for piece, index in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{index}:{piece}\n".encode("utf-8", "surrogatepass"))
    for f in files:
        st = f.stat()
        h.update(os.fsencode(f.resolve()) + f"|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return cache_root() / "draft_vocab" / f"{h.hexdigest()[:32]}.npy"


def token_counts(tokenizer: Any, vocab_size: int, corpus: str | None = None) -> np.ndarray:
    """int64 [vocab_size]: how often each token id occurs in the corpus's files (their first MAX_CORPUS_CHARS
    characters), tokenized in pieces of ~1 M characters without special tokens. Cached on disk, written atomically; an
    unwritable cache is skipped and an unreadable one recounted.

    Raises:
        ValueError: the corpus is not a file or directory of text, or holds no token (empty files).
    """
    files = corpus_files(corpus)
    cache = _cache_path(tokenizer, files)
    if cache.is_file():
        try:
            counts = np.load(cache, allow_pickle=False)
            if counts.shape == (vocab_size,) and counts.dtype == np.int64 and counts.any():
                logger.info("draft vocabulary: token counts of %d corpus files from %s", len(files), cache)
                return counts
        except (OSError, ValueError, EOFError):
            pass  # a cache cut short or overwritten: count again
    counts = np.zeros(vocab_size, dtype=np.int64)
    chars = 0
    batch: list[str] = []  # small files' pieces, tokenized together up to PIECE_CHARS
    batch_chars = 0
    for piece in _pieces(files, MAX_CORPUS_CHARS):
        batch.append(piece)
        batch_chars += len(piece)
        if batch_chars >= PIECE_CHARS or len(batch) >= 64:
            _count(tokenizer, batch, counts)
            chars += batch_chars
            batch, batch_chars = [], 0
    _count(tokenizer, batch, counts)
    chars += batch_chars
    if not counts.any():
        raise ValueError(f"speculative_draft_vocab_corpus {corpus!r} holds no text to count tokens on")
    logger.info("draft vocabulary: counted %d tokens (%d distinct) in %d characters of %d corpus files%s",
                int(counts.sum()), int(np.count_nonzero(counts)), chars, len(files),
                f" (the first {MAX_CORPUS_CHARS} characters)" if chars >= MAX_CORPUS_CHARS else "")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            np.save(out, counts)
        os.replace(tmp, cache)  # atomic: a reader sees the old file or the whole new one
    except OSError:
        pass
    return counts


def _count(tokenizer: Any, texts: list[str], counts: np.ndarray) -> None:
    if not texts:
        return
    vocab_size = len(counts)
    for ids in _encode_all(tokenizer, texts):
        a = np.asarray(ids, dtype=np.int64)
        counts += np.bincount(a[(a >= 0) & (a < vocab_size)], minlength=vocab_size)


def draft_vocabulary(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """int64 [n], sorted ascending: the `size` most frequent token ids of `counts` (ties to the lower id), plus every
    id in `always` (the stop and special tokens, so that the draft can end an answer); n <= size + len(always).

    Raises:
        ValueError: size < 1.
    """
    if size < 1:
        raise ValueError(f"speculative_draft_vocab_size must be >= 1, got {size}")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id ascending
    chosen = set(order[: min(size, len(counts))].tolist())
    chosen.update(int(t) for t in always if 0 <= int(t) < len(counts))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def special_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's added and special token ids (end of turn, end of text, tool-call markers, ...), sorted."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    return sorted(ids)


def restrict_lm_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Make `model.compute_logits` compute the logits of `token_ids` only ([n, vocab_size] float32 out, -inf at every
    other id), by slicing the rows of its LM head's weight: packed parts (loom/quant/layout.py) row by row, a dense
    weight by index. The head's own tensors are replaced, never written, so a tied embedding keeps its full matrix.

    Raises:
        ValueError: the head is split over tensor-parallel ranks, or held in a form this cannot slice.
    """
    head = model.lm_head
    vocab = head.output_size
    ids = token_ids.to(torch.int64).sort().values.unique()
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
        raise ValueError(f"the draft vocabulary must hold ids in [0, {vocab})")
    if getattr(head, "shard", None) is not None:
        raise ValueError("a draft vocabulary needs the draft's LM head on one rank")
    if getattr(head, "packed", None):
        parts, biases, start = [], [], 0
        for p, b in zip(head.packed, head.packed_bias, strict=True):
            rows = p.shape[0]
            local = ids[(ids >= start) & (ids < start + rows)] - start
            if local.numel():
                kept = p.rows(local.to(p.qweight.device))  # of an interleaved matrix: row-major rows
                parts.append(interleave_rows16(kept) if p.layout in INTERLEAVED and interleavable(kept) else kept)
                biases.append(None if b is None else b[local.to(b.device)].contiguous())
            start += rows
        head.packed, head.packed_bias = parts, biases
    elif getattr(head, "dense_weight", None) is not None:
        head.dense_weight = head.dense_weight[ids.to(head.dense_weight.device)].contiguous()
    elif getattr(head, "fp8_weight", None) is not None:  # an FP8 checkpoint's head: its e4m3 rows and their scales
        rows = ids.to(head.fp8_weight.device)
        head.fp8_weight, head.fp8_scale = head.fp8_weight[rows].contiguous(), head.fp8_scale[rows].contiguous()
    elif isinstance(getattr(head, "weight", None), torch.Tensor):
        head.weight = nn.Parameter(head.weight.data[ids.to(head.weight.device)].contiguous(), requires_grad=False)
    else:
        raise ValueError(f"the draft's LM head ({type(head.quant_method).__name__}) cannot be restricted to a draft "
                         "vocabulary")
    if getattr(head, "bias", None) is not None:
        head.bias = nn.Parameter(head.bias.data[ids.to(head.bias.device)].contiguous(), requires_grad=False)
    head.output_size = int(ids.numel())
    compute = model.compute_logits
    on_device: dict[torch.device, torch.Tensor] = {}

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        sub = compute(hidden)  # [n, len(ids)]
        index = on_device.get(sub.device)
        if index is None:
            index = on_device[sub.device] = ids.to(sub.device)
        return sub.new_full((sub.shape[0], vocab), float("-inf")).index_copy_(1, index, sub)

    model.compute_logits = compute_logits
    model.draft_vocabulary = ids
