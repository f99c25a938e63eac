"""Hypothesis strategies for request bodies: mostly plausible, often wrong, always cheap to serve.

Generation length stays bounded: max_tokens / max_completion_tokens are always small ints or junk
that must be refused, never absent (a chat request without them could run to max_model_len).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=8),
)
_junk = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.dictionaries(st.text(max_size=4), _scalars, max_size=2))


def _field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, _junk)


_small_tokens = st.one_of(st.integers(min_value=-2, max_value=4), st.just(-(10**12)), st.text(max_size=2),
                          st.floats(min_value=0, max_value=3, width=32), st.booleans())

_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": _field(st.sampled_from(["__served__", "no-such-model"])),
    "n": _field(st.integers(min_value=-1, max_value=3) | st.just(10**6)),
    "temperature": _field(st.floats(min_value=-1, max_value=3, width=32)),
    "top_p": _field(st.floats(min_value=-0.5, max_value=1.5, width=32)),
    "top_k": _field(st.integers(min_value=-3, max_value=100)),
    "min_p": _field(st.floats(min_value=-0.5, max_value=1.5, width=32)),
    "stop": _field(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3))),
    "seed": _field(st.integers(min_value=-(2**64), max_value=2**64)),
    "presence_penalty": _field(st.floats(min_value=-3, max_value=3, width=32)),
    "frequency_penalty": _field(st.floats(min_value=-3, max_value=3, width=32)),
    "repetition_penalty": _field(st.floats(min_value=-1, max_value=3, width=32)),
    "logit_bias": _field(st.dictionaries(st.sampled_from(["0", "1", "50", "-1", "999999999", "x"]),
                                         st.floats(min_value=-150, max_value=150, width=32), max_size=2)),
    "stop_token_ids": _field(st.lists(st.integers(min_value=-5, max_value=10**9), max_size=2)),
    "min_tokens": _field(st.integers(min_value=-1, max_value=6)),
    "ignore_eos": _field(st.booleans()),
    "skip_special_tokens": _field(st.booleans()),
    "include_stop_str_in_output": _field(st.booleans()),
    "cache_salt": _field(st.text(max_size=4)),
    "user": _field(st.text(max_size=4)),
    "stream": st.booleans(),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "unknown_field": _junk,
}

_prompt = st.one_of(
    st.text(min_size=0, max_size=12),
    st.lists(st.text(max_size=6), min_size=0, max_size=2),
    st.lists(st.integers(min_value=-3, max_value=60_000), min_size=0, max_size=6),
    st.lists(st.lists(st.integers(min_value=0, max_value=200), min_size=0, max_size=3), max_size=2),
    _junk,
)
_message = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["system", "user", "assistant", "tool", "robot"])),
     "content": _field(st.one_of(st.text(max_size=12),
                                 st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                 "text": st.text(max_size=6)}), max_size=2)))})


def _optional(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def completion_bodies() -> st.SearchStrategy[dict[str, Any]]:
    extra = {"echo": _field(st.booleans()), "logprobs": _field(st.integers(min_value=-1, max_value=25)),
             "suffix": st.one_of(st.none(), st.text(max_size=2)), "best_of": _field(st.integers(0, 3))}
    return st.builds(lambda req, opt: {**opt, **req},
                     st.fixed_dictionaries({"prompt": _prompt, "max_tokens": _small_tokens}),
                     _optional({**_COMMON, **extra}))


def chat_bodies() -> st.SearchStrategy[dict[str, Any]]:
    extra = {"logprobs": _field(st.booleans()), "top_logprobs": _field(st.integers(min_value=-1, max_value=25)),
             "tools": _field(st.lists(st.just({"type": "function"}), max_size=1))}
    return st.builds(lambda req, opt: {**opt, **req},
                     st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, min_size=0, max_size=3), _junk),
                                            "max_tokens": _small_tokens, "max_completion_tokens": _small_tokens}),
                     _optional({**_COMMON, **extra}))


def resolve_model(body: dict[str, Any], served: str) -> dict[str, Any]:
    if body.get("model") == "__served__":
        body["model"] = served
    return body
