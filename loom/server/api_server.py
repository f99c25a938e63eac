"""The FastAPI app: OpenAI-compatible routes over an AsyncLLMEngine, built by `build_app`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from loom import __version__ as loom_version
from loom.engine.async_engine import AsyncLLMEngine
from loom.router.result_cache import ResultCache
from loom.server.metrics import ServerMetrics
from loom.server.content_type import not_json_message
from loom.server.security import SecurityConfig, install_security
from loom.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest, check_token_ids,
)
from loom.server.serving_chat import chat_prompt_ids, create_chat_completion, tool_dicts
from loom.server.serving_common import RETRY_AFTER_S, ServingContext, check_model
from loom.server.serving_completion import create_completion
from loom.server.serving_result_cache import ResultCacheCollector
from loom.server.tool_parsers import DEFAULT_TOOL_CALL_PARSER, get_tool_call_parser

logger = logging.getLogger(__name__)

_JSON_CHUNK = 32768  # ints per json.dumps call: ~5 ms holding the GIL


def int_list_json(values: list[int]) -> str:
    """The JSON array body (without brackets) of `values`, encoded in chunks of _JSON_CHUNK.

    json.dumps holds the GIL for the whole list: for the 5 M ids of a 5 MB /tokenize prompt that is ~1 s during
    which the event loop (health probes, streams) cannot run, even from a worker thread. Between chunks the
    interpreter hands the GIL over, so the loop waits ~5 ms at most."""
    return ",".join(json.dumps(values[i:i + _JSON_CHUNK], separators=(",", ":"))[1:-1]
                    for i in range(0, len(values), _JSON_CHUNK))


CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"
MODEL_IDENTITY_HEADER = "x-loom-model-identity"  # the digest of the model that answered (loom_model_identity)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                415: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


def escaped(text: str) -> str:
    """`text` with any lone UTF-16 surrogate written as its \\uXXXX escape (as the client's JSON had it), so an
    error that quotes a request string can always be encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    body = {"error": {"message": escaped(message), "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else escaped(param), "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and first.get("type") == "missing":
        return "The request body is empty: send a JSON object (Content-Type: application/json).", None
    if not loc and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return f"The request body must be a JSON object, not {_json_kind(first.get('input'))}.", None
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first.get("type") == "string_unicode" and isinstance(first.get("input"), str):
        # pydantic reads a model's keys as Rust strings, which a lone surrogate cannot be; values are checked by
        # protocol.check_unicode. A top-level key is a parameter name: named as the client wrote it.
        key = escaped(first["input"])
        if not loc:
            return f"{key}: unknown parameter whose name contains a lone UTF-16 surrogate: not valid Unicode", key
        return f"{where}: the key '{key}' contains a lone UTF-16 surrogate: not valid Unicode", param
    if first.get("type") == "extra_forbidden":
        return (f"{where}: unknown parameter; loom does not implement it (docs/serving.md lists the "
                "parameters)"), param
    if first.get("type") == "value_error" and first.get("ctx", {}).get("error") is not None:
        # a validator's own ValueError: its message as written, without pydantic's "Value error, " prefix
        return f"{where}: {first['ctx']['error']}", param
    return f"{where}: {first.get('msg', 'invalid value')}", param


def _json_kind(value: Any) -> str:
    """What JSON value `value` (as json.loads gives it) is, in words: 'a JSON array', 'a JSON string', ..."""
    kinds = ((bool, "a JSON boolean"), (int, "a JSON number"), (float, "a JSON number"), (str, "a JSON string"),
             (list, "a JSON array"), (type(None), "JSON null"))
    return next((word for kind, word in kinds if isinstance(value, kind)), "a JSON object")


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        if isinstance(exc.body, (bytes, bytearray)):  # not parsed: its Content-Type is not JSON's (or is missing)
            return error_response(415, not_json_message(request.headers.get("content-type")))
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    async def on_request_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return error_response(exc.status_code, exc.message, exc.param, exc.code)

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None and not isinstance(cause, StarletteHTTPException):
            # FastAPI's "There was an error parsing the body": JSON that Python's json refuses, say why
            if isinstance(cause, RecursionError):
                return error_response(400, "Malformed JSON: the request body is nested too deeply.")
            return error_response(400, f"Malformed JSON: {str(cause).split(';')[0]}")
        return error_response(exc.status_code, str(exc.detail))

    async def on_any(request: Request, exc: Exception) -> Response:
        if isinstance(exc, RecursionError):  # absurdly nested JSON: the client's fault
            return error_response(400, "Request body is nested too deeply.")
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}")

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_any)


def build_app(engine: AsyncLLMEngine, served_model_name: str | None = None,
              disconnect_poll_s: float = 0.05, security: SecurityConfig | None = None,
              tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, result_cache: ResultCache | None = None) -> FastAPI:
    """Build the OpenAI-compatible app over a started AsyncLLMEngine.

    The app has its own Prometheus registry (app.state.metrics). It does not start or stop the
    engine: the caller owns its lifecycle (see loom.server.cli). `security`: API key, CORS, trusted
    hosts and the body limit (loom/server/security.py); None = its defaults (no key, no CORS, any host,
    32 MiB bodies). `tool_call_parser`: the format of tool calls (loom/server/tool_parsers.py).
    `result_cache`: whole responses of deterministic requests (loom/server/serving_result_cache.py); None = off.

    Raises:
        ValueError: an unknown tool_call_parser.
    """
    ctx = ServingContext(engine, served_model_name or engine.model_name, disconnect_poll_s,
                         get_tool_call_parser(tool_call_parser), result_cache,
                         engine.model_identity.digest if result_cache is not None else "")
    metrics = ServerMetrics(ctx.model_name)
    if result_cache is not None:
        metrics.registry.register(ResultCacheCollector(result_cache, ctx.model_name))
    engine.add_listener(metrics)
    app = FastAPI(title="loom", description="OpenAI-compatible LLM server")
    app.state.ctx = ctx
    app.state.metrics = metrics
    _install_error_handlers(app)
    install_security(app, security or SecurityConfig())
    created = int(time.time())

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:  # a browser chat over the API (as llama-server has): one static file
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "The engine is not running.", code="engine_not_running")
        return JSONResponse({"status": "ok"})

    agent = getattr(getattr(engine, "engine", None), "kv_transfer", None)  # prefill/decode disaggregation
    kv_transfer_role = agent.config.role if agent is not None else None

    @app.get("/load")
    async def load() -> dict[str, Any]:  # what a router balances on (loom router's least-load and cache-aware)
        stats = engine.get_stats()
        return {"num_requests_running": getattr(stats, "num_running", 0),
                "num_requests_waiting": getattr(stats, "num_waiting", 0),
                "kv_cache_usage": getattr(stats, "kv_cache_usage", 0.0),
                "prefix_cache_queries": getattr(stats, "prefix_cache_queries", 0),
                "prefix_cache_hits": getattr(stats, "prefix_cache_hits", 0),
                "kv_transfer_role": kv_transfer_role}

    # loom_model_identity: the weights, quantization, dtypes and tokenizer as hashes (loom/engine/model_identity.py),
    # so a router or a client's cache can tell two versions of one name apart
    model_card = {"id": ctx.model_name, "object": "model", "created": created, "owned_by": "loom",
                  "root": ctx.model_name, "max_model_len": engine.max_model_len,
                  "loom_model_identity": engine.model_identity.card()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:  # the openai client's models.retrieve
        check_model(ctx, model_id)
        return model_card

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": loom_version}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:  # vLLM's route: lets clients (lm-eval) take our tokenizer
        tok = engine.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "vocab_size": engine.vocab_size,
                                "model_max_length": engine.max_model_len,
                                "chat_template": getattr(tok, "chat_template", None)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = value if isinstance(value, str) else None
        return info

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # every answer says which model produced it: a router's result cache stores it only under that identity (a
    # replica restarted at the same URL with other weights is not known to the router until its next check)
    identity_header = {MODEL_IDENTITY_HEADER: model_card["loom_model_identity"]["digest"]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        response = await create_completion(ctx, body, raw)
        response.headers.update(identity_header)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        response = await create_chat_completion(ctx, body, raw)
        response.headers.update(identity_header)
        return response

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        check_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if body.tools is not None and body.messages is None:
            raise RequestError("tools go with messages (the chat prompt they are rendered into)", "tools")

        def work() -> Response:  # templating and tokenizing are CPU work: in a worker thread
            if body.messages is not None:
                tokens = chat_prompt_ids(ctx, body.messages, body, tool_dicts(body.tools))
            else:
                try:  # the same character bound as a completion prompt: refused before it is tokenized
                    engine.check_prompt_chars(body.prompt)
                except ValueError as e:
                    raise RequestError(str(e), "prompt") from e
                tokens = list(engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            body_json = (f'{{"tokens":[{int_list_json(tokens)}],"count":{len(tokens)},'
                         f'"max_model_len":{engine.max_model_len}}}')
            return Response(body_json, media_type="application/json")

        return await asyncio.to_thread(work)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        check_model(ctx, body.model)

        def work() -> Response:
            check_token_ids("tokens", body.tokens, engine.vocab_size)
            return JSONResponse({"prompt": str(engine.tokenizer.decode(body.tokens, skip_special_tokens=False))})

        return await asyncio.to_thread(work)

    return app


__all__ = ["build_app", "error_response"]
