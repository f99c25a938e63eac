"""Incremental detokenization: token ids in, one at a time; text deltas out.

Built on `tokenizers.decoders.DecodeStream` (tokenizers >= 0.21), which re-decodes a short window
of recent ids and emits only the new, complete text: a UTF-8 character split over several byte-level
BPE tokens comes out whole once its last byte arrives, never as U+FFFD. The stream is seeded with the
last prompt tokens so the first generated token decodes in context (a leading space stays a space,
a word piece continues the prompt's word).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the stream as context; DecodeStream itself keeps a window of this order.
PROMPT_CONTEXT_TOKENS = 6


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the argument itself).

    Raises:
        ValueError: `tokenizer` has no fast (Rust `tokenizers`) backend.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    raise ValueError(f"tokenizer must be a fast tokenizer backed by `tokenizers`, got {type(tokenizer).__name__}")


class IncrementalDetokenizer:
    """Text deltas of one request's generated tokens.

    Invariant: the concatenation of every `step()` result followed by `flush()` equals the decode of
    the generated ids in the context of the prompt (for a byte-level BPE tokenizer, simply
    `tokenizer.decode(output_ids, skip_special_tokens=...)`).
    """

    __slots__ = ("_tokenizer", "_stream", "_skip_special_tokens", "_pending", "_context")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        """Args:
        tokenizer: a transformers fast tokenizer or a `tokenizers.Tokenizer`.
        prompt_token_ids: [num_prompt_tokens]; the last few seed the stream as context.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.

        Raises:
            ValueError: the tokenizer has no fast backend.
        """
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith("\ufffd"):
            # The prompt ends inside a character: that text cannot be a stable prefix, so the output
            # is decoded on its own (its leading bytes then decode as U+FFFD, as `decode` shows them).
            context = []
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._context: list[int] = context  # ids before the pending ones, to decode them in context at flush
        self._pending: list[int] = []  # ids fed since the last emitted text (an incomplete character)

    def step(self, token_id: int) -> str:
        """Feed one generated token id; return the text it completes ("" while a character is incomplete)."""
        text = self._stream.step(self._tokenizer, token_id)
        self._pending.append(token_id)
        if text is None:
            return ""
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending = []
        return text

    def flush(self) -> str:
        """Text of the ids still held back (an incomplete UTF-8 sequence), decoded as `decode` would:
        with U+FFFD for the missing bytes. Call once, when the request finishes."""
        pending, context = self._pending, self._context
        self._pending = []
        self._context = (context + pending)[-PROMPT_CONTEXT_TOKENS:]
        if not pending:
            return ""
        base = self._decode(context)
        full = self._decode(context + pending)
        if base.endswith("\ufffd") or not full.startswith(base):
            return self._decode(pending)
        return full[len(base):]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of a single token on its own (special tokens kept), as logprobs report it.

    A token holding part of a multi-byte character decodes to U+FFFD, like every single-token decode.
    """
    return backend_tokenizer(tokenizer).decode([token_id], skip_special_tokens=False)
