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

With speculative decoding (docs/speculative.md, "Structured output"), the scheduler first truncates a request's
drafts to the longest prefix its grammar accepts (`valid_draft_len`, llguidance's validate_tokens); the verify
pass then masks each of its k + 1 positions with the grammar's state after the drafts before it (`bitmasks`:
the matcher consumes the drafts, a mask after each, and rolls back), so the target's token at every position is
one the grammar allows there, exactly as if it had been decoded alone. The tokens kept are consumed lazily, as
any output token.

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

    def _matcher(self, request_id: str, spec: StructuredOutputParams, output_token_ids: list[int]) -> Any:
        """The request's matcher, created on first use, after it consumed every output token. A token the
        grammar refuses leaves it in llguidance's error state (it never leaves it): `bitmasks` raises then."""
        import llguidance

        state = self._matchers.get(request_id)
        if state is not None and state[1] > len(output_token_ids):  # the id of a finished request, reused
            state = None
        if state is None:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), self.compile(spec))
            state = self._matchers[request_id] = [matcher, 0]
        matcher, consumed = state
        if consumed < len(output_token_ids):
            matcher.consume_tokens(output_token_ids[consumed:])
            state[1] = len(output_token_ids)
        return matcher

    def valid_draft_len(self, request_id: str, spec: StructuredOutputParams, output_token_ids: list[int],
                        draft_token_ids: list[int]) -> int:
        """How many leading drafts the grammar accepts after `output_token_ids` (speculative decoding: the
        scheduler truncates each request's drafts to that prefix before verification). The matcher's state is
        unchanged but for the output tokens it had not seen; an end-of-sequence draft counts only while the
        grammar may still continue (a finished grammar's EOS is forced: the target emits it anyway). Never
        raises for a matcher in error (0: `bitmasks` reports it inside the step)."""
        matcher = self._matcher(request_id, spec, output_token_ids)
        if matcher.is_error():
            return 0
        # llguidance puts a matcher in its error state for an id past its vocabulary even when only validating
        vocab = self._ll_tokenizer().vocab_size
        in_vocab = next((i for i, t in enumerate(draft_token_ids) if not 0 <= t < vocab), len(draft_token_ids))
        return int(matcher.validate_tokens(list(draft_token_ids[:in_vocab]))) if in_vocab else 0

    def bitmask(self, request_id: str, spec: StructuredOutputParams, output_token_ids: list[int]) -> torch.Tensor:
        """The allowed tokens after `output_token_ids`, as int32 [ceil(vocab_size / 32)] (bit t % 32 of word
        t // 32). Creates the request's matcher on first use; consumes the tokens it has not seen.

        Raises:
            RuntimeError: the output left the grammar (a token the mask forbade was appended).
        """
        masks, _ = self.bitmasks(request_id, spec, output_token_ids, [])
        return masks[0]

    def bitmasks(self, request_id: str, spec: StructuredOutputParams, output_token_ids: list[int],
                 draft_token_ids: list[int]) -> tuple[torch.Tensor, int]:
        """The allowed tokens at each position of a verify pass: row j is the mask after `output_token_ids`
        and the first j drafts, int32 [len(draft_token_ids) + 1, ceil(vocab_size / 32)], and how many leading
        drafts the grammar accepts (rows past that one repeat its mask; they are never kept, see the runner).

        The matcher walks the valid drafts and rolls back, so its state afterwards is as before but for
        output tokens it had not seen (it follows the output lazily; the kept tokens are consumed at the next
        call). Only a token consumed while the matcher was not stopped is rolled back: a stopped matcher (the
        grammar is complete) takes EOS without recording it.

        Raises:
            RuntimeError: the output left the grammar, or the rollback failed.
        """
        import llguidance.numpy  # not llguidance.torch: it pulls in torch.jit (deprecated) for the same buffer

        matcher = self._matcher(request_id, spec, output_token_ids)
        if matcher.is_error():
            raise RuntimeError(f"request {request_id}: output left its grammar: {matcher.get_error()}")
        num_valid = self.valid_draft_len(request_id, spec, output_token_ids, draft_token_ids) if draft_token_ids else 0
        masks = llguidance.numpy.allocate_token_bitmask(len(draft_token_ids) + 1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, masks, 0)
        recorded = 0
        try:
            for j, token in enumerate(draft_token_ids[:num_valid]):
                stopped = matcher.is_stopped()
                if not matcher.consume_token(token):
                    raise RuntimeError(f"request {request_id}: a validated draft left the grammar: "
                                       f"{matcher.get_error()}")
                recorded += 0 if stopped else 1
                llguidance.numpy.fill_next_token_bitmask(matcher, masks, j + 1)
        finally:
            if recorded and not matcher.rollback(recorded):
                raise RuntimeError(f"request {request_id}: grammar rollback failed: {matcher.get_error()}")
        masks[num_valid + 1 :] = masks[num_valid]
        return torch.from_numpy(masks), num_valid

    def free(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)


__all__ = ["StructuredOutputManager", "grammar_text"]
