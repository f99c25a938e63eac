"""Per-request sampling parameters and their semantics.

| parameter | meaning | valid range | off value |
|---|---|---|---|
| n | independent samples (completions) returned for the prompt | >= 1 (<= 128) | 1 |
| temperature | logits are divided by it before softmax; 0 means greedy (argmax) | >= 0 | 1.0 (0 = greedy) |
| top_k | keep only the k most likely tokens | -1, 0 or >= 1 | -1 or 0 |
| top_p | keep the smallest set of most likely tokens whose probability sums to >= top_p | (0, 1] | 1.0 |
| min_p | drop tokens whose probability is below min_p x the top token's probability | [0, 1] | 0.0 |
| repetition_penalty | logits of tokens seen in prompt or output: positive / p, negative * p (CTRL paper) | > 0 | 1.0 |
| presence_penalty | subtracted once from the logit of every token already generated (OpenAI) | [-2, 2] | 0.0 |
| frequency_penalty | subtracted per occurrence from the logit of tokens already generated (OpenAI) | [-2, 2] | 0.0 |
| logit_bias | token id -> value added to its logit | values in [-100, 100] | None |
| seed | seed of this request's own generator: same seed, same samples, whatever the batch | an int64 or None | None |
| max_tokens | most tokens generated | >= 0 or None (until max_model_len) | 16 |
| min_tokens | no stop (EOS, stop_token_ids, stop strings) can end the request before this many tokens | >= 0, <= max_tokens | 0 |
| stop | strings that end generation when they appear in the text | list of non-empty str | [] |
| stop_token_ids | token ids that end generation (kept in the token ids; their text is not shown) | list of int | [] |
| ignore_eos | do not stop on the end-of-sequence set (tokenizer EOS + generation-config EOS ids) | bool | False |
| include_stop_str_in_output | keep the matched stop string in the text | bool | False |
| logprobs | return the sampled token's logprob plus this many top logprobs (raw log-softmax of the model) | None or 0..20 | None |
| prompt_logprobs | same for every prompt token (the first has none) | None or 0..20 | None |
| skip_special_tokens | drop special tokens from the text | bool | True |
| structured_output | constrain the output to a JSON schema, any JSON object, a regex, one of some strings, or a Lark grammar (StructuredOutputParams; loom/sample/structured.py) | exactly one constraint | None |

The "raw" logprobs are computed from the model's logits before temperature, penalties and truncation,
as vLLM does by default.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields

from loom.core.kv_retention import KV_RETENTION_POLICIES, check_budget

MAX_LOGPROBS = 20
MAX_N = 128


@dataclass(slots=True)
class StructuredOutputParams:
    """One constraint on the generated text (set exactly one field); vLLM's `structured_outputs` names.

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular expression the
    whole output matches (Rust regex syntax); choice: the output is exactly one of these strings; grammar: a
    context-free grammar in Lark syntax (llguidance's dialect). The grammar engine is llguidance
    (loom/sample/structured.py); the constraint is checked and compiled when the request is added.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def verify(self) -> None:
        """Raise ValueError unless exactly one constraint of the right type is set."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be a boolean, got {self.json_object!r}")
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_output needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_output.json must be a JSON schema (object or string), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_output.choice must be a non-empty list of non-empty strings")

    def key(self) -> str:
        """A canonical text of the constraint (the compile cache's key)."""
        import json as _json

        # not sort_keys: a schema's property order is the order its output must follow
        return _json.dumps([self.json, self.json_object, self.regex, self.choice, self.grammar])


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutputParams | None = None
    # long context (loom/core/kv_retention.py): this request's KV retention policy and budget; None = the engine's
    kv_retention: str | None = None
    kv_retention_budget: float | None = None  # <= 1: fraction of the prompt's tokens; > 1: tokens

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # sequences become lists; anything else (a number, a string of ids) is left for verify() to name
        if self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the first invalid parameter (run at construction and again when a request
        is added, so values changed in between are checked too)."""
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        if not isinstance(self.stop, list):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.kv_retention is not None and self.kv_retention not in KV_RETENTION_POLICIES:
            raise ValueError(f"kv_retention must be one of {list(KV_RETENTION_POLICIES)}, got {self.kv_retention!r}")
        if self.kv_retention_budget is not None:
            check_budget(self.kv_retention_budget)
        _int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    raise ValueError(f"logit_bias keys must be token ids (integers), got {token_id!r}")
                if token_id < 0:  # an id past the vocabulary is caught where the vocabulary is known (the engine)
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id}")
                _finite("logit_bias", bias)
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.seed is not None:
            _int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:  # OpenAI's seed is an int64; wider ones wrapped onto it silently
                raise ValueError(f"seed must be a 64-bit signed integer, in [-2^63, 2^63 - 1], got {self.seed}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens)
            if self.max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise ValueError("structured_output must be a StructuredOutputParams")
            self.structured_output.verify()
            # a finished grammar allows only the end-of-sequence token: nothing could be sampled
            if self.ignore_eos:
                raise ValueError("structured_output cannot be combined with ignore_eos")
            if self.min_tokens:
                raise ValueError("structured_output cannot be combined with min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """The same prompt gets the same output on every run: greedy, or sampled from the request's own seed."""
        return self.temperature == 0.0 or self.seed is not None

    def cache_key(self) -> str:
        """Canonical JSON of every field (a result cache's key part; equal keys, equal parameters).

        Floats are written as floats (temperature 0 and 0.0 agree), logit_bias as [token id, bias] pairs sorted
        by id, stop and stop_token_ids in their order, structured_output as StructuredOutputParams.key() (a
        schema's property order kept: it orders the output). A field added later is included by construction.
        """
        return json.dumps({f.name: _canonical(f.type, getattr(self, f.name)) for f in fields(self)},
                          separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def _canonical(annotation: object, value: object) -> object:
    """A JSON-ready, order-canonical form of one SamplingParams field (see SamplingParams.cache_key)."""
    if isinstance(value, StructuredOutputParams):
        return value.key()
    if isinstance(value, dict):
        return sorted([int(k), float(v)] for k, v in value.items())
    if isinstance(value, int) and not isinstance(value, bool) and str(annotation).startswith("float"):
        return float(value)
    return value


def _int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
