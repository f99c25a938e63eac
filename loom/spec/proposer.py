"""Proposers: the seam of speculative decoding, and the n-gram (prompt lookup) proposer.

A proposer sees one request's tokens (prompt then output so far) and returns at most k draft tokens that
the target model verifies in its next pass. It never decides what is emitted: a wrong draft costs one
verified position, never a wrong token (loom/spec/verify.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


def check_suffix_options(max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                         max_spec_offset: float, min_token_prob: float) -> None:
    """Raises ValueError naming the first suffix_decoding_* option out of range."""
    if max_tree_depth < 2:
        raise ValueError(f"suffix_decoding_max_tree_depth must be >= 2, got {max_tree_depth}")
    if max_cached_requests < 0:
        raise ValueError(f"suffix_decoding_max_cached_requests must be >= 0, got {max_cached_requests}")
    if not max_spec_factor > 0:
        raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got {max_spec_factor}")
    if not max_spec_offset >= 0:
        raise ValueError(f"suffix_decoding_max_spec_offset must be >= 0, got {max_spec_offset}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {min_token_prob}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`--speculative-method`, `--num-speculative-tokens` and each method's options.

    Raises:
        ValueError: an unknown method or an out-of-range option, naming it.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: most draft tokens per request and step
    prompt_lookup_min: int = 2  # ngram: shortest suffix (tokens) that may match
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first
    # no drafts in a step whose running batch has at least this many requests (vLLM's option of the same
    # name); None = never off. Past ~2 requests a step's M > 1 tiles are compute-bound and a verify row
    # costs about as much as a decode row (benchmarks/NOTES.md, "When to speculate")
    disable_by_batch_size: int | None = 3
    # suffix (vLLM's suffix_decoding_* options; loom/spec/suffix.py)
    suffix_max_tree_depth: int = 24  # longest substring the suffix trees count (match plus drafts), tokens
    suffix_max_cached_requests: int = 128  # earlier outputs in the global tree; 0 = per-request trees only
    suffix_max_spec_factor: float = 1.0  # drafts <= factor * match length + offset
    suffix_max_spec_offset: float = 0.0
    suffix_min_token_prob: float = 0.1  # stop drafting once the estimated probability of the run drops below
    # tree candidates: most candidate continuations verified per greedy request and step (1 = one chain of
    # drafts). Each extra branch costs its own verify rows (loom/spec/verify.py, "Tree candidates").
    tree_width: int = 1
    # draft_model: the draft's GGUF file or Hugging Face directory (vLLM's speculative_config "model")
    model: str | None = None
    # draft_model: the draft's weight quantization method (vLLM's speculative_config "quantization");
    # None = the target's. A draft's error costs acceptance, never a wrong token.
    quantization: str | None = None
    # draft_model: the draft's LM head restricted to this many most frequent tokens plus the special ones (FR-Spec,
    # loom/spec/draft_vocab.py), counted on draft_vocab_corpus (a file or directory; None = Python's stdlib source);
    # None = the whole vocabulary
    draft_vocab_size: int | None = None
    draft_vocab_corpus: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.tree_width <= 8:
            raise ValueError(f"speculative_tree_width must be in [1, 8], got {self.tree_width}")
        if self.tree_width > 1 and self.method == "draft_model":
            raise ValueError("speculative_tree_width > 1 needs speculative_method 'ngram' or 'suffix' (the draft "
                             "model proposes one chain)")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1 or None ('none' on the command line), "
                             f"got {self.disable_by_batch_size}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                             f"got {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_method 'draft_model' needs speculative_model (the draft's path)")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError(f"speculative_quantization is only used by speculative_method 'draft_model', "
                             f"got method {self.method!r}")
        if self.draft_vocab_size is not None and self.method != "draft_model":
            raise ValueError(f"speculative_draft_vocab_size is only used by speculative_method 'draft_model', "
                             f"got method {self.method!r}")
        if self.draft_vocab_size is not None and (isinstance(self.draft_vocab_size, bool) or not isinstance(
                self.draft_vocab_size, int) or self.draft_vocab_size < 1):
            raise ValueError(f"speculative_draft_vocab_size must be an integer >= 1, got {self.draft_vocab_size!r}")
        if self.draft_vocab_corpus is not None and not isinstance(self.draft_vocab_corpus, (str, os.PathLike)):
            raise ValueError(f"speculative_draft_vocab_corpus must be a path, got {self.draft_vocab_corpus!r}")
        if self.draft_vocab_corpus is not None and self.draft_vocab_size is None:
            raise ValueError("speculative_draft_vocab_corpus needs speculative_draft_vocab_size")
        if self.draft_vocab_corpus is not None and not os.path.exists(self.draft_vocab_corpus):
            raise ValueError(f"speculative_draft_vocab_corpus path {self.draft_vocab_corpus!r} does not exist")
        if self.draft_vocab_corpus is not None and self.draft_vocab_size is not None:
            # a corpus with nothing to count is refused here, not after both models have loaded
            from loom.spec.draft_vocab import corpus_files

            corpus = os.fspath(self.draft_vocab_corpus)
            if not any(path.stat().st_size for path in corpus_files(corpus)):
                raise ValueError(f"speculative_draft_vocab_corpus {corpus!r} holds only empty files")
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"speculative_model path {self.model!r} does not exist")
        if self.model is not None and self.method != "draft_model":
            raise ValueError(f"speculative_model is only used by speculative_method 'draft_model', "
                             f"got method {self.method!r}")
        check_suffix_options(self.suffix_max_tree_depth, self.suffix_max_cached_requests,
                             self.suffix_max_spec_factor, self.suffix_max_spec_offset, self.suffix_min_token_prob)


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One request to draft for in a step."""

    request_id: str
    token_ids: Sequence[int]  # the request's prompt then output tokens (>= 1)
    max_tokens: int  # >= 1: most drafts wanted


class Proposer(Protocol):
    """Drafts tokens for the decoding requests of a step, all at once (`propose_batch`), or for one.

    A request's token_ids only ever grow between calls (rejected drafts are never part of them, and a
    preempted request keeps its tokens), so a proposer may keep per-request state keyed by request_id and
    ingest only the tokens it has not seen. The scheduler calls `request_finished` once per request, on
    every way it ends (stopped, length, aborted), so that state is freed and may feed a cache of earlier
    outputs. Drafts never decide what is emitted (loom/spec/verify.py): state that goes stale costs
    acceptance, never a wrong token.
    """

    name: str

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """token_ids: the request's prompt then output tokens (>= 1); max_tokens >= 0 -> at most max_tokens
        draft tokens to follow token_ids (possibly none)."""
        ...

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """The drafts of each request, in order: what `propose` gives for each (a proposer that runs a model
        runs it once for the batch)."""
        ...

    def propose_branches(self, requests: Sequence[DraftRequest], max_branches: int) -> list[list[list[int]]]:
        """Tree candidates: up to max_branches (>= 1) different non-empty draft runs per request, the best
        first (branch 0 is what `propose_batch` gives); [] for a request with no draft."""
        ...

    def request_finished(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended with these generated tokens; forget its state (unknown ids are ignored)."""
        ...


class DraftGrammar(Protocol):
    """Checks the drafts of a structured-output request against its grammar before they are verified
    (loom/sample/structured.py's StructuredOutputManager is the one implementation): a draft the grammar
    forbids could never be kept, so verifying it would only cost a row."""

    def valid_draft_len(self, request_id: str, spec: Any, output_token_ids: list[int],
                        draft_token_ids: list[int]) -> int:
        """How many leading drafts the grammar of `spec` (a StructuredOutputParams) accepts after the request's
        output so far; never raises for a request whose output already left its grammar (0)."""
        ...


class PerRequestProposer:
    """Base of the proposers that draft for one request at a time: a batch is a loop."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose(r.request_id, r.token_ids, r.max_tokens) for r in requests]

    def propose_candidates(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                           max_branches: int) -> list[list[int]]:
        """Up to max_branches different draft runs for one request, the best first; a proposer without
        alternatives gives its one run."""
        drafts = self.propose(request_id, token_ids, max_tokens)
        return [drafts] if drafts else []

    def propose_branches(self, requests: Sequence[DraftRequest], max_branches: int) -> list[list[list[int]]]:
        return [self.propose_candidates(r.request_id, r.token_ids, r.max_tokens, max_branches) for r in requests]


class NgramProposer(PerRequestProposer):
    """Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): find the most recent
    earlier occurrence of the request's last n tokens, for n from prompt_lookup_max down to
    prompt_lookup_min, and propose the tokens that followed it. Pays off where the output copies its
    input: code edits, quoting, summaries that reuse phrases."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        candidates = self.propose_candidates(request_id, token_ids, max_tokens, 1)
        return candidates[0] if candidates else []

    def propose_candidates(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                           max_branches: int) -> list[list[int]]:
        """Branch 0 follows the most recent occurrence of the longest matching suffix; the others follow
        earlier occurrences (longest suffix first, most recent first) whose next token differs from every
        branch taken so far, so that no two branches share a first draft."""
        total = len(token_ids)
        if max_tokens <= 0 or total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        branches: list[list[int]] = []
        firsts: set[int] = set()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # windows starting at 0 .. total - n - 1: every occurrence that ends before the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            for hit in hits[::-1]:  # most recent first
                start = int(hit) + n  # the token after the match
                first = int(tokens[start])
                if first in firsts:
                    continue
                firsts.add(first)
                branches.append(tokens[start : start + max_tokens].tolist())
                if len(branches) == max_branches:
                    return branches
        return branches

    def request_finished(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        pass  # stateless: every call searches the tokens it is given


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What the engine knows that a proposer running a model of its own needs."""

    dtype: str  # the target's --dtype (the draft runs at the same one)
    quantization: str | None  # the target's --quantization
    seed: int
    block_size: int  # tokens per KV block
    kv_cache_memory_bytes: int  # the draft's KV budget
    device: Any  # torch.device of the target
    max_model_len: int  # the target's, tokens
    vocab_size: int  # the target's
    tokenizer: Any  # the target's (the draft must tokenize the same way)


def _draft_model(c: SpeculativeConfig, ctx: ProposerContext | None) -> Proposer:
    from loom.config import CacheConfig, ModelConfig
    from loom.spec.draft_model import DraftModelProposer
    from loom.worker.model_runner import ModelRunner

    if ctx is None:
        raise ValueError("speculative_method 'draft_model' needs the engine's context (ProposerContext)")
    counts = None
    if c.draft_vocab_size is not None and c.draft_vocab_size < ctx.vocab_size:
        from loom.spec.draft_vocab import token_counts

        if ctx.tokenizer is None:
            raise ValueError("speculative_draft_vocab_size needs the target's tokenizer to count tokens with")
        # before the draft loads, so a bad corpus fails fast; the draft must share this tokenizer (checked below)
        counts = token_counts(ctx.tokenizer, ctx.vocab_size, c.draft_vocab_corpus)
    try:
        runner = ModelRunner(
            ModelConfig(model=c.model, dtype=ctx.dtype, max_model_len=None, seed=ctx.seed,
                        quantization=c.quantization if c.quantization is not None else ctx.quantization),
            CacheConfig(block_size=ctx.block_size, kv_cache_memory_bytes=ctx.kv_cache_memory_bytes,
                        enable_prefix_caching=False, hybrid_kv_cache=False),  # the draft's own plain block table
            ctx.device)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_model (the draft): {e}") from e
    if runner.arch.vocab_size != ctx.vocab_size:
        raise ValueError(f"speculative_model {c.model!r} has a vocabulary of {runner.arch.vocab_size} tokens, the "
                         f"target {ctx.vocab_size}: the draft must share the target's tokenizer")
    probe = "def f(x):\n    return x  # The quick brown fox, 42 times: ünïcödé."
    if runner.tokenizer is None or list(runner.tokenizer.encode(probe)) != list(ctx.tokenizer.encode(probe)):
        raise ValueError(f"speculative_model {c.model!r} tokenizes text differently from the target: the draft "
                         "must share the target's tokenizer")
    if counts is not None:
        from loom.spec.draft_vocab import draft_vocabulary, restrict_lm_head, special_token_ids

        vocabulary = draft_vocabulary(counts, c.draft_vocab_size, special_token_ids(runner.tokenizer))
        restrict_lm_head(runner.model, vocabulary)
        logger.info("draft vocabulary: the draft's LM head computes %d of %d tokens (the %d most frequent in %s, "
                    "plus the special ones)", len(vocabulary), runner.arch.vocab_size, c.draft_vocab_size,
                    c.draft_vocab_corpus or "Python's standard library source")
        seen = int(np.count_nonzero(counts))
        if seen < c.draft_vocab_size:
            logger.warning("speculative_draft_vocab_corpus has only %d distinct tokens, fewer than "
                           "speculative_draft_vocab_size %d: the rest are taken by lowest id", seen,
                           c.draft_vocab_size)
    elif c.draft_vocab_size is not None:
        logger.info("draft vocabulary: speculative_draft_vocab_size %d >= the vocabulary (%d): the whole head runs",
                    c.draft_vocab_size, runner.arch.vocab_size)
    return DraftModelProposer(runner, ctx.max_model_len)


def _suffix(c: SpeculativeConfig, ctx: ProposerContext | None = None) -> Proposer:
    from loom.spec.suffix import SuffixProposer

    return SuffixProposer(c.suffix_max_tree_depth, c.suffix_max_cached_requests, c.suffix_max_spec_factor,
                          c.suffix_max_spec_offset, c.suffix_min_token_prob)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, ProposerContext | None], Proposer]] = {
    "ngram": lambda c, ctx=None: NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max),
    "suffix": _suffix,
    "draft_model": _draft_model,
}


def make_proposer(config: SpeculativeConfig, context: ProposerContext | None = None) -> Proposer:
    """The registered proposer of config.method; context is needed by the ones that run a model.

    Raises:
        ValueError: no proposer is registered under config.method, or it cannot be built (the draft model
            does not load or does not share the target's tokenizer).
    """
    factory = PROPOSERS.get(config.method)
    if factory is None:
        raise ValueError(f"speculative_method must be one of {sorted(PROPOSERS)}, got {config.method!r}")
    return factory(config, context)
