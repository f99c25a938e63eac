"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams.

Types are strict (no "0.5" for a float, no true for an int) and non-finite floats are refused, so
wrong types never reach the engine. Every user error becomes `RequestError` (HTTP 400) naming the
parameter, before the engine sees the request. A field no model here declares is refused with a 400 naming
it (extra="forbid"): a parameter loom does not implement is never silently ignored (vLLM's `guided_json`
and `use_beam_search` used to be; both work now). The few OpenAI fields that ask nothing of an inference server (`store`,
`metadata`, `service_tier`, `user`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator,
                      model_validator)

from loom.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from loom.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16  # OpenAI allows 4; we allow a few more


class RequestError(ValueError):
    """An error answered with an OpenAI-style body: client errors (400/404, naming `param`), plus the
    503 (queue full, shutting down) and 500 (engine failure) a handler turns into the same shape."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message  # human-readable explanation
        self.param = param  # the offending request field, or None
        self.status_code = status_code  # HTTP status (400, 404, 503)
        self.code = code  # short machine-readable code, e.g. "model_not_found"


def check_unicode(value: Any) -> None:
    """Raise ValueError if a string in `value` (nested lists and dicts, keys included) is not valid Unicode:
    JSON's \\ud800-style escapes can carry lone UTF-16 surrogates, which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            raise ValueError(f"contains a lone UTF-16 surrogate (U+{code:04X}) at character {exc.start}: "
                             "not valid Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key)
            check_unicode(item)
    elif isinstance(value, (list, tuple)):
        if value and type(value[0]) is int:
            return  # token ids: the request types make such a list all ints, and 10^6 of them cost no scan
        for item in value:
            check_unicode(item)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # every string field, at the edge: a surrogate would otherwise fail deep in the tokenizer (a 500)
        if not isinstance(value, BaseModel):  # nested models check their own fields
            check_unicode(value)
        return value


class StreamOptions(_Strict):
    include_usage: bool = False  # send a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # accepted and ignored


Float = Annotated[float, Field(allow_inf_nan=False)]
Stop = str | list[str] | None
TokenIdList = list[int]

PROMPT_SHAPES = "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids"


def one_of(shapes: str, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`value` validated by `handler` (a wrap validator's: its field's type, a union of `shapes`, described in words);
    a value of none of the shapes raises ValueError("must be <shapes>"), where pydantic's own error for a union
    names one branch as if the value had to be that one ("prompt.str: Input should be a valid string" for
    ["a", 1]). A validator's error (a lone surrogate in a string of the right shape) passes through as it is.

    Raises:
        ValueError: `value` has none of the shapes.
        ValidationError: `value` has one of them but is invalid otherwise.
    """
    try:
        return handler(value)
    except ValidationError as exc:
        if any(e["type"] in ("value_error", "assertion_error") for e in exc.errors()):
            raise
        raise ValueError(f"must be {shapes}") from None


def _admits_none(annotation: Any) -> bool:
    return annotation is None or type(None) in get_args(annotation)


class _SamplingFields(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions (OpenAI names plus extras)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI's API marks n, stream, logprobs, ... nullable: null there means "the default". A field whose
        # own type admits None keeps it (max_tokens: null = until max_model_len).
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and not _admits_none(fields[k].annotation))}
        return data

    @field_validator("early_stopping", mode="before", check_fields=False)
    @classmethod
    def _early_stopping(cls, value: Any) -> Any:
        if value is True or value is False or value == "never":
            return value
        raise ValueError(f'early_stopping must be true, false or "never", got {value!r}')

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return one_of("a string or a list of strings", value, handler)

    model: str | None = None  # served model name; None = the one model served
    n: int = 1  # samples per prompt
    temperature: Float | None = None  # None = 1.0
    top_p: Float | None = None  # None = 1.0
    stop: Stop = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # accepted for compatibility, unused
    store: bool | None = None  # OpenAI stores the completion for its dashboard: nothing to store here, unused
    metadata: dict[str, str] | None = None  # OpenAI's tags for stored completions, unused
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras beyond the OpenAI API
    top_k: int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # separates prefix-cache entries between tenants
    # long context (docs/long_context.md): this request's KV retention policy and budget (None = the server's)
    kv_retention: str | None = None  # full | sinks | h2o | snapkv
    kv_retention_budget: Float | None = None  # <= 1: fraction of the prompt's tokens; > 1: tokens
    # prefill/decode disaggregation (docs/disaggregation.md): {"do_remote_decode": true} on a prefill replica,
    # {"do_remote_prefill": true, ...what the prefill returned} on a decode replica
    kv_transfer_params: dict[str, Any] | None = None
    # structured output (at most one of these; structured_output_of): OpenAI's response_format, vLLM's extras
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark syntax (llguidance)
    request_id: str | None = Field(default=None, max_length=256)  # client id echoed in the response id
    prompt_logprobs: int | None = None  # vLLM: logprobs of every prompt token plus this many top ones (0..20)
    # beam search (vLLM's and transformers' names): width = best_of or n, the n best returned
    use_beam_search: bool = False
    length_penalty: Float = 1.0  # a finished beam scores cumulative logprob / length ** length_penalty
    early_stopping: bool | Literal["never"] = False  # transformers' stopping rule (loom/engine/beam_search.py)


class CompletionRequest(_SamplingFields):
    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return one_of(PROMPT_SHAPES, value, handler)

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # None = until max_model_len
    echo: bool = False  # prepend the prompt to each choice's text (and its logprobs)
    logprobs: int | None = None  # top logprobs per token, 0..20
    suffix: str | None = None  # not supported: refused with 400 when set
    best_of: int | None = None  # sample this many (>= n) and return the n of highest cumulative logprob


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of the arguments object (OpenAI's shape)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # text, or content parts of type "text"
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return one_of('a string, a list of content parts ({"type": "text", "text": ...}) or null', value, handler)

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # OpenAI: only an assistant turn may omit its content (it may carry tool calls instead)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role!r} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role!r} one")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to a tool message, not a {self.role!r} one")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments always follow the schema when a grammar holds the call


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class _ChatTemplateFields(_Strict):
    """How the conversation goes through the chat template (vLLM's extras)."""

    add_generation_prompt: bool = True  # end with the assistant header
    continue_final_message: bool = False  # continue the last (assistant) message instead
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated OpenAI name
    max_completion_tokens: int | None = None  # preferred; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true
    tools: list[ToolDefinition] | None = None  # functions the model may call (loom/server/tool_calls.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # False: at most one call (held by the grammar under "required")


class TokenizeRequest(_ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # alternative to prompt: tokenize the chat prompt
    tools: list[ToolDefinition] | None = None  # with messages: rendered as a chat request's tools are (vLLM's)
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


_STRUCTURED_KEYS = frozenset(StructuredOutputParams.__dataclass_fields__)  # json, json_object, regex, ...


def structured_output_error(exc: ValueError, req: _SamplingFields) -> RequestError:
    """The engine's refusal of a constraint ("structured_output is invalid: ...") as a 400 naming, in its message and
    its param, the field the client sent (response_format, guided_regex, ...)."""
    field = structured_output_of(req)[1]
    message = str(exc)
    if field and message.startswith("structured_output "):
        message = field + message[len("structured_output"):]
    return RequestError(message, field)


def structured_output_of(req: _SamplingFields) -> tuple[StructuredOutputParams | None, str | None]:
    """The constraint a request asks for, and the field that asked (for errors), or (None, None).

    Raises:
        RequestError: more than one field asks, or one is malformed (naming it).
    """
    asked = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar") if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.get("type", "text") == "text":
        asked.remove("response_format")  # plain text: no constraint
    if not asked:
        return None, None
    if len(asked) > 1:
        raise RequestError(f"give at most one of {', '.join(asked)}", asked[1])
    name = asked[0]
    try:
        if name == "response_format":
            kind = req.response_format.get("type")
            if kind == "json_object":
                spec = StructuredOutputParams(json_object=True)
            elif kind == "json_schema":
                inner = req.response_format.get("json_schema")
                if not isinstance(inner, dict):
                    raise RequestError('response_format of type json_schema needs "json_schema": {"name": ..., '
                                       '"schema": {...}}', name)
                if not isinstance(inner.get("schema"), dict):
                    raise RequestError("response_format.json_schema.schema must be a JSON schema object", name)
                spec = StructuredOutputParams(json=inner["schema"])
            else:
                raise RequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                   name)
        elif name == "structured_outputs":
            unknown = set(req.structured_outputs) - _STRUCTURED_KEYS
            if unknown:
                raise RequestError(f"structured_outputs has unknown keys {sorted(unknown)}; known: "
                                   f"{sorted(_STRUCTURED_KEYS)}", name)
            spec = StructuredOutputParams(**req.structured_outputs)
        else:
            key = name.removeprefix("guided_")
            spec = StructuredOutputParams(**{key: getattr(req, name)})
        spec.verify()
    except ValueError as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(f"{name}: {e}", name) from e
    return spec, name


def _range(name: str, value: float | int | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", name)


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """Raise RequestError when an id is outside [0, vocab_size)."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"{name} contains token id {t} outside the vocabulary [0, {vocab_size})", name)


def to_sampling_params(req: _SamplingFields, max_tokens: int | None, vocab_size: int,
                       logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """Translate the validated body into SamplingParams. Raises RequestError naming the parameter."""
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:  # OpenAI and vLLM refuse it too
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if max_tokens is not None and max_tokens < 0:
        raise RequestError(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if req.temperature is not None and req.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    _range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _range("min_p", req.min_p, 0.0, 1.0)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {req.repetition_penalty}", "repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise RequestError(f"top_k must be -1 (off), 0 (off) or >= 1, got {req.top_k}", "top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise RequestError("stop strings must not be empty", "stop")
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    logit_bias = _logit_bias(req.logit_bias, vocab_size)
    structured, _ = structured_output_of(req)
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        _range(name, value, 0, MAX_LOGPROBS)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=-1 if req.top_k is None else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_output=structured,
            kv_retention=req.kv_retention,
            kv_retention_budget=req.kv_retention_budget,
        )
    except ValueError as e:  # SamplingParams' own checks: its messages start with the parameter name
        param = param_of(str(e))
        if param is None and str(e).startswith("structured_output"):
            raise structured_output_error(e, req) from e
        raise RequestError(str(e), param) from e


# fields beam search does not use: set with use_beam_search they are a 400 rather than silently ignored
BEAM_SEARCH_REFUSED = (
    "stream", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "stop", "min_tokens", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "include_stop_str_in_output", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "tools", "tool_choice", "kv_retention", "kv_retention_budget",
)
# values of those fields that change nothing (sent explicitly by some clients): accepted with beam search
BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "stop": ([], ""), "logit_bias": ({},), "min_tokens": (0,), "tools": ([],),
    "tool_choice": ("none",), "response_format": ({"type": "text"},), "stream": (False,), "echo": (False,),
}


def to_beam_search_params(req: _SamplingFields, max_tokens: int | None, vocab_size: int) -> BeamSearchParams | None:
    """BeamSearchParams for a body with use_beam_search (None without): beam width = best_of when given, else n;
    the n best sequences are returned. Raises RequestError naming the parameter: beam-search options without
    use_beam_search, a sampling option beam search does not use (BEAM_SEARCH_REFUSED; temperature other than
    0), a width or max_tokens out of range."""
    if not req.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if name in req.model_fields_set:
                raise RequestError(f"{name} applies to beam search only (set use_beam_search)", name)
        return None
    fields = type(req).model_fields
    for name in BEAM_SEARCH_REFUSED:
        if name not in fields:
            continue
        value = getattr(req, name)
        if value is None or value == fields[name].default or value in BEAM_SEARCH_NEUTRAL.get(name, ()):
            continue
        raise RequestError(f"{name} cannot be combined with use_beam_search (beam search ranks sequences by the "
                           f"model's log-probabilities)", name)
    if req.temperature not in (None, 0):
        raise RequestError("temperature must be 0 or unset with use_beam_search (beam search does not sample)",
                           "temperature")
    best_of = getattr(req, "best_of", None)
    width, width_name = (best_of, "best_of") if best_of is not None else (req.n, "n")
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise RequestError(f"the beam width ({width_name}) must be in [1, {MAX_BEAM_WIDTH}], got {width}",
                           width_name)
    if not 1 <= req.n <= width:
        raise RequestError(f"n must be in [1, best_of={width}], got {req.n}", "n")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1 with use_beam_search, got {max_tokens}", "max_tokens")
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    try:
        return BeamSearchParams(beam_width=width, n=req.n, max_tokens=max_tokens,
                                length_penalty=req.length_penalty, early_stopping=req.early_stopping,
                                ignore_eos=req.ignore_eos, stop_token_ids=stop_token_ids,
                                skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:  # BeamSearchParams' own checks: their messages start with the parameter name
        raise RequestError(str(e), param_of(str(e))) from e


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        # ASCII decimal digits only: int() would also read " 3_0 " as 30 and Arabic-Indic digits as theirs
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias keys must be token ids in decimal digits, got {key[:40]!r}",
                               "logit_bias")
        if len(key) > 12 or int(key) >= vocab_size:  # the length first: int() refuses 4,300+ digits
            raise RequestError(f"logit_bias token id {key[:40]} is outside the vocabulary [0, {vocab_size})",
                               "logit_bias")
        token_id = int(key)
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[token_id] = value
    return out


_KNOWN_PARAMS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def param_of(message: str) -> str | None:
    """The parameter an engine/SamplingParams ValueError names (its first word), if it is one."""
    first = message.split(" ", 1)[0].strip(":,.'\"")
    return first if first in _KNOWN_PARAMS else None


__all__ = [
    "RequestError", "StreamOptions", "CompletionRequest", "ChatMessage", "ChatCompletionRequest",
    "TokenizeRequest", "DetokenizeRequest", "to_sampling_params", "to_beam_search_params", "check_token_ids", "param_of",
    "INT64_MIN", "INT64_MAX", "TokenIdList",
]
