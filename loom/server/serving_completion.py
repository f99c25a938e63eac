"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loom.engine.async_engine import RequestStream
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import MAX_N
from loom.server.protocol import (
    CompletionRequest,
    RequestError,
    check_token_ids,
    to_beam_search_params,
    to_sampling_params,
)
from loom.server.serving_result_cache import look_up
from loom.server.serving_common import (
    SSE_DONE, SSE_ENGINE_ERROR, EngineStreamingResponse, ServingContext, check_beam_width, check_kv_transfer,
    check_model, check_prompt_logprobs, check_room, check_structured_output, collect, completion_logprobs, failed,
    merge, new_request_id, now_unix, prompt_logprobs_body, prompt_logprobs_done, raise_if_failed, sse, submit_all,
    until_disconnected, usage,
)

MAX_CHOICES = 1024  # prompts x n in one request


@dataclass(slots=True)
class _Prompt:
    engine_prompt: str | list[int]  # what the engine gets
    text: str  # the prompt as text, for echo


# fill-in-the-middle special tokens (prefix, suffix, middle) of the model families that have them, PSM order
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
              ("<PRE>", "<SUF>", "<MID>"))  # Code Llama (sentencepiece pieces)


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), or None when it has none."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for names in FIM_TOKENS:
        if all(n in vocab for n in names):
            return names
    return None


def _fim_prompt(ctx: ServingContext, body: CompletionRequest) -> str:
    """`suffix`: the prompt as fill-in-the-middle, prefix-suffix-middle (Bavarian et al. 2022, "Efficient
    Training of Language Models to Fill in the Middle"): <prefix>prompt<suffix>suffix<middle>.

    Raises:
        RequestError: a prompt that is not one string, or a model without FIM tokens (naming suffix).
    """
    if not isinstance(body.prompt, str):
        raise RequestError("suffix needs the prompt as one string", "suffix")
    names = fim_tokens(ctx.engine.tokenizer)
    if names is None:
        raise RequestError("suffix needs a model with fill-in-the-middle tokens (e.g. Qwen2.5-Coder); this "
                           "tokenizer has none", "suffix")
    pre, suf, mid = names
    return f"{pre}{body.prompt}{suf}{body.suffix}{mid}"


def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[_Prompt]:
    p = body.prompt
    tokenizer = ctx.engine.tokenizer
    if body.suffix is not None:
        text = _fim_prompt(ctx, body)
        try:
            ids = ctx.engine.tokenize(text)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from e
        check_room(ctx, len(ids), body.max_tokens, "max_tokens", default="max_tokens" not in body.model_fields_set)
        return [_Prompt(ids, p)]
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif not p:
        raise RequestError("prompt must not be empty", "prompt")
    elif isinstance(p[0], int):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    out = []
    for item in items:
        if isinstance(item, list):
            if not item:
                raise RequestError("prompt token lists must not be empty", "prompt")
            check_token_ids("prompt", item, ctx.engine.vocab_size)
            out.append(_Prompt(item, str(tokenizer.decode(item, skip_special_tokens=False)) if body.echo else ""))
        else:
            try:  # tokenized here (a worker thread), so the room check below sees its length
                ids = ctx.engine.tokenize(item)
            except ValueError as e:
                raise RequestError(str(e), "prompt") from e
            if not ids:
                raise RequestError("prompt must not be empty", "prompt")
            out.append(_Prompt(ids, item))
        check_room(ctx, len(out[-1].engine_prompt), body.max_tokens, "max_tokens",
                   default="max_tokens" not in body.model_fields_set)
    if len(out) * body.n > MAX_CHOICES:
        raise RequestError(f"prompts x n must be <= {MAX_CHOICES}, got {len(out) * body.n}", "prompt")
    return out


def _validate(ctx: ServingContext, body: CompletionRequest) -> tuple[list[_Prompt], Any]:
    check_model(ctx, body.model)
    beam = to_beam_search_params(body, body.max_tokens, ctx.engine.vocab_size)
    if beam is not None:
        check_beam_width(ctx, beam, "best_of" if body.best_of is not None else "n")
        return _prompts(ctx, body), beam
    if body.best_of is not None:
        if not body.n <= body.best_of <= MAX_N:
            raise RequestError(f"best_of must be in [n, {MAX_N}] (n = {body.n}), got {body.best_of}", "best_of")
        if body.stream and body.best_of > body.n:
            raise RequestError("best_of > n cannot be streamed (the best are known at the end)", "best_of")
    num_logprobs = body.logprobs
    check_prompt_logprobs(body)
    asked = [n for n in (body.prompt_logprobs, num_logprobs if body.echo else None) if n is not None]
    params = to_sampling_params(body, body.max_tokens, ctx.engine.vocab_size, num_logprobs,
                                max(asked) if asked else None)
    if _ranks(body):  # best_of candidates: sum their tokens' logprobs (logprobs 0: the chosen token's only)
        params.n = body.best_of
        params.logprobs = num_logprobs if num_logprobs is not None else 0
    check_structured_output(ctx, body, params)
    prompts = _prompts(ctx, body)
    check_kv_transfer(body, len(prompts))
    return prompts, params


def _choice_logprobs(ctx: ServingContext, body: CompletionRequest, out: RequestOutput, c: CompletionOutput,
                     prompt: _Prompt) -> dict[str, Any] | None:
    if body.logprobs is None:
        return None
    tok = ctx.engine.tokenizer
    ids, entries = list(c.token_ids), list(c.logprobs or [])
    if body.echo:
        prompt_entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        ids, entries = list(out.prompt_token_ids) + ids, prompt_entries + entries
    return completion_logprobs(tok, ids, entries, body.logprobs, 0)


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request) -> Response:
    """Serve one /v1/completions request. Raises RequestError for client errors (400/404/503)."""
    arrival = time.monotonic()
    prompts, params = await asyncio.to_thread(_validate, ctx, body)  # CPU work: off the event loop
    response_id = f"cmpl-{body.request_id}" if body.request_id else new_request_id("cmpl")
    cached = look_up(ctx.result_cache, ctx.model_identity, raw, body,
                     [list(p.engine_prompt) for p in prompts], params)  # every prompt is token ids by now
    if cached.found is not None:
        return cached.hit_response(response_id, now_unix())
    streams = await submit_all(ctx, "cmpl", [p.engine_prompt for p in prompts], params, arrival, body.cache_salt,
                               body.kv_transfer_params)
    if body.stream:
        return cached.finish_stream(EngineStreamingResponse(
            cached.record(_stream(ctx, body, prompts, streams, response_id)), streams))
    try:
        gone, finals = await until_disconnected(raw, collect(streams), ctx.disconnect_poll_s)
    finally:
        for s in streams:
            s.close()
    if gone:
        return Response(status_code=499)
    raise_if_failed(finals)
    used = _usage(finals)  # every candidate's tokens were generated, the best_of ones too
    if _ranks(body):
        finals = [_best(out, body.n) for out in finals]
    return cached.finish(await asyncio.to_thread(_render, ctx, body, finals, prompts, response_id, used))


def _ranks(body: CompletionRequest) -> bool:
    """best_of > n: the server samples best_of candidates per prompt and returns the n best."""
    return body.best_of is not None and body.best_of > body.n and not body.use_beam_search


def _best(out: RequestOutput, n: int) -> RequestOutput:
    """`out` with its n candidates of highest cumulative logprob, re-indexed 0..n-1 (OpenAI's best_of: "the one
    with the highest log probability per token"; summed here, as vLLM ranks)."""
    ranked = sorted(out.outputs, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    kept = [dataclasses.replace(c, index=i) for i, c in enumerate(ranked)]
    return dataclasses.replace(out, outputs=kept)


def _render(ctx: ServingContext, body: CompletionRequest, finals: Sequence[RequestOutput], prompts: list[_Prompt],
            response_id: str, used: dict[str, Any]) -> JSONResponse:
    """The non-streamed text_completion body (echo, logprobs decoded, JSON encoded): run in a worker thread."""
    choices = []
    for i, (out, prompt) in enumerate(zip(finals, prompts)):
        for c in out.outputs:
            choices.append({
                "index": i * body.n + c.index,
                "text": (prompt.text if body.echo else "") + c.text,
                "logprobs": _choice_logprobs(ctx, body, out, c, prompt),
                **({} if body.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_body(
                    ctx.engine.tokenizer, out.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs)}),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": now_unix(), "model": ctx.model_name,
        "choices": choices, "usage": used,
        **({"kv_transfer_params": finals[0].kv_transfer_params} if finals and finals[0].kv_transfer_params else {}),
    })


def _usage(finals: Sequence[RequestOutput]) -> dict[str, Any]:
    return usage(sum(len(o.prompt_token_ids) for o in finals),
                 sum(len(c.token_ids) for o in finals for c in o.outputs),
                 sum(o.num_cached_tokens for o in finals))


@dataclass(slots=True)
class _ChoiceState:
    """What one streamed choice has sent so far."""

    chars: int = 0  # characters of the cumulative text
    tokens: int = 0  # generated tokens covered by sent logprobs
    offset: int = 0  # text_offset of the next token
    finished: bool = False
    started: bool = False


@dataclass(slots=True)
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> newest output


async def _stream(ctx: ServingContext, body: CompletionRequest, prompts: list[_Prompt],
                  streams: list[RequestStream], response_id: str) -> AsyncIterator[str]:
    created, st = now_unix(), _StreamState()
    tok = ctx.engine.tokenizer
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    null_usage = {"usage": None} if with_usage else {}  # OpenAI: every chunk but the last carries usage null
    # a choice's first chunk carries the prompt's logprobs (`prompt_logprobs`, as in the non-streamed choice;
    # echo with logprobs, in its `logprobs`): it waits until all of them have arrived (a chunked prefill
    # delivers them over several steps)
    wants_prompt = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
    try:
        async for i, out in merge(streams):
            st.finals[i] = out
            for c in out.outputs:
                index = i * body.n + c.index
                cs = st.choices.setdefault(index, _ChoiceState())
                if cs.finished:
                    continue
                if not cs.started and wants_prompt and not prompt_logprobs_done(out) and c.finish_reason is None:
                    continue  # nothing sent for this choice yet, so nothing is lost by waiting
                text, logprobs = c.text[cs.chars:], None
                if not cs.started and body.echo:
                    text = prompts[i].text + text
                    cs.offset = 0
                if body.logprobs is not None:
                    ids, entries = list(c.token_ids[cs.tokens:]), list((c.logprobs or [])[cs.tokens:])
                    if not cs.started and body.echo:
                        ids = list(out.prompt_token_ids) + ids
                        entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
                    logprobs = completion_logprobs(tok, ids, entries, body.logprobs, cs.offset)
                    cs.offset += sum(len(t) for t in logprobs["tokens"])
                cs.chars, cs.tokens = len(c.text), len(c.token_ids)
                cs.finished = c.finish_reason is not None
                if not text and not cs.finished and not (logprobs and logprobs["tokens"]):
                    continue
                choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
                if not cs.started and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = await asyncio.to_thread(
                        prompt_logprobs_body, tok, out.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs)
                cs.started = True
                yield sse({"id": response_id, "object": "text_completion", "created": created,
                           "model": ctx.model_name,
                           "choices": [{**choice, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                           **null_usage})
        if with_usage:
            yield sse({"id": response_id, "object": "text_completion", "created": created,
                       "model": ctx.model_name, "choices": [], "usage": _usage(list(st.finals.values()))})
        if failed(list(st.finals.values())):
            yield SSE_ENGINE_ERROR
        yield SSE_DONE
    finally:
        for s in streams:
            s.close()


__all__ = ["create_completion"]
