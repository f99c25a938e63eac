"""Structured output: constrain sampling to a JSON schema, any JSON object, a regex, a choice or a grammar.

Each step, a request with a constraint gets a token bitmask (bit t of word t // 32 set = token t allowed) from
its grammar matcher; the sampler sets the logits of the other tokens to -inf (sampler.apply_token_bitmask)
after penalties and before greedy or random choice, so greedy picks the most likely *allowed* token. The
matcher then consumes the sampled token. The grammar engine is llguidance (Microsoft's Rust engine behind
Guidance; Moskal et al., github.com/guidance-ai/llguidance): it runs on any CPU, takes a Hugging Face tokenizer
as it is, computes a 49k-token mask in ~0.1 ms, and installs as one 3 MB wheel with no dependencies.
xgrammar (the other engine vLLM uses) pulls in triton on Linux, about 150 MB the CPU never uses.

Matchers follow the output lazily: before computing a mask, the matcher consumes whatever output tokens it has
not seen yet. That keeps it right across preemption (a recomputed request keeps its output tokens) and needs no
hook where tokens are appended. A request's matcher is dropped when the request finishes.

Constraints are compiled when a request is added (`compile`), so a bad schema is a ValueError at the edge (a
400 naming the parameter on the server), and cached by their canonical text.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from loom.sampling_params import StructuredOutputParams

logger = logging.getLogger(__name__)

COMPILE_CACHE_SIZE = 256  # compiled constraints kept
# Whitespace a JSON output may put between two tokens. llguidance's default allows any amount, and small models
# then loop on newlines until max_tokens (SmolLM2 did on an array schema): bounded as xgrammar bounds it. A
# schema's own top-level "x-guidance" options win.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


def grammar_text(spec: StructuredOutputParams) -> str:
    """llguidance's grammar (its JSON envelope) for a constraint. Raises ValueError for a JSON schema that is
    not valid JSON text."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema: Any = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output.json is not valid JSON: {exc}") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Lark alternation of string literals; json.dumps quotes and escapes each as a Lark string
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class StructuredOutputManager:
    """Compiles constraints and keeps one grammar matcher per running request with one.

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's logit columns (may exceed the tokenizer's: those ids are never allowed).
        eos_token_ids: the tokens that end a request; the grammar allows them once it is complete.

    Raises:
        ValueError: a tokenizer llguidance cannot wrap (a slow, non-Rust tokenizer).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None  # built on first use (~0.3 s for 49k tokens)
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._matchers: dict[str, list[Any]] = {}  # request id -> [matcher, output tokens consumed]

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance.hf

            try:
                self._lltok = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
            except Exception as exc:  # noqa: BLE001 - llguidance raises its own types for unsupported tokenizers
                raise ValueError(f"structured output needs a fast (Rust) Hugging Face tokenizer: {exc}") from None
        return self._lltok

    def compile(self, spec: StructuredOutputParams) -> str:
        """The checked grammar of `spec` (cached).

        Raises:
            ValueError: the constraint is invalid (bad schema, regex or grammar), with llguidance's reason.
        """
        spec.verify()
        key = spec.key()
        grammar = self._compiled.get(key)
        if grammar is not None:
            self._compiled.move_to_end(key)
            return grammar
        import llguidance

        try:
            grammar = grammar_text(spec)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance's parse errors
            raise ValueError(f"structured_output is invalid: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error:
            raise ValueError(f"structured_output is invalid: {error}")
        self._compiled[key] = grammar
        if len(self._compiled) > COMPILE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return grammar

    def bitmask(self, request_id: str, spec: StructuredOutputParams, output_token_ids: list[int]) -> torch.Tensor:
        """The allowed tokens after `output_token_ids`, as int32 [ceil(vocab_size / 32)] (bit t % 32 of word
        t // 32). Creates the request's matcher on first use; consumes the tokens it has not seen.

        Raises:
            RuntimeError: the output left the grammar (a token the mask forbade was appended).
        """
        import llguidance
        import llguidance.numpy  # not llguidance.torch: it pulls in torch.jit (deprecated) for the same buffer

        state = self._matchers.get(request_id)
        if state is not None and state[1] > len(output_token_ids):  # the id of a finished request, reused
            state = None
        if state is None:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), self.compile(spec))
            state = self._matchers[request_id] = [matcher, 0]
        matcher, consumed = state
        if consumed < len(output_token_ids):
            if not matcher.consume_tokens(output_token_ids[consumed:]):
                raise RuntimeError(f"request {request_id}: output left its grammar: {matcher.get_error()}")
            state[1] = len(output_token_ids)
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        return torch.from_numpy(mask[0])

    def free(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)


__all__ = ["StructuredOutputManager", "grammar_text"]
