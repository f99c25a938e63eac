"""Asyncio front of the engine: one background thread owns the LLMEngine, one output queue per request.

The LLMEngine is not thread-safe and its steps are CPU-heavy, so exactly one thread (the "engine
thread") touches it: it drains a thread-safe command queue (add / abort) between steps, runs
`step()`, and hands each RequestOutput to the asyncio queue of its request with
`loop.call_soon_threadsafe`. The asyncio side never calls the engine directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loom.core.scheduler import QueueFullError
from loom.executor.base import ExecutorDiedError
from loom.kernels.openmp import release_thread_pool
from loom.outputs import CompletionOutput, RequestOutput
from loom.engine.beam_search import BeamSearchParams
from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down, or never started)."""


class StepListener(Protocol):
    """Told about every step from the engine thread (metrics). Must be quick and thread-safe."""

    def on_step(self, outputs: Sequence[RequestOutput], stats: Any, now: float) -> None: ...


@dataclass(slots=True)
class _Stream:
    """Where one request's outputs go (owned by the engine thread once the request is added)."""

    loop: asyncio.AbstractEventLoop  # the event loop the consumer awaits on
    queue: asyncio.Queue[RequestOutput | BaseException]  # outputs, then a final one with finished=True
    n: int  # number of samples, for the synthetic final output when the request fails
    last: RequestOutput | None = None  # newest output delivered, to build that final output

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


@dataclass(slots=True)
class _Add:
    request_id: str  # engine-unique id
    prompt: str | list[int]  # text or token ids
    prompt_token_ids: list[int] | None  # the text already tokenized (off the engine thread), or None
    params: SamplingParams | BeamSearchParams
    arrival_time: float  # time.monotonic() seconds
    cache_salt: str | None
    stream: _Stream
    done: concurrent.futures.Future[None]  # resolved by the engine thread: None, or add_request's error
    kv_transfer: Any = None  # the validated kv_transfer_params (loom.kv_transfer.base.KVTransferRequest) or None
    remote_kv: Any = None  # a decode request's pulled prompt K/V (RemoteKV), or None: compute the prompt


@dataclass(slots=True)
class _Abort:
    request_id: str
    stream: _Stream | None = None  # abort only if the id still maps to this stream; None = whatever it maps to


@dataclass(slots=True)
class _Call:
    fn: Callable[[Any], Any]  # run on the engine thread with the engine as its argument
    done: concurrent.futures.Future[Any]


_Command = _Add | _Abort | _Call


@dataclass(slots=True)
class _Loop:
    """State that only the engine thread touches."""

    streams: dict[str, _Stream] = field(default_factory=dict)  # request_id -> stream
    stats: Any = None  # newest engine.get_stats()


class AsyncLLMEngine:
    """Asyncio-facing wrapper around an LLMEngine that runs its step loop in a background thread.

    Call `start()` once (or use `from_engine_args`), `generate()` from any event loop, and
    `shutdown()` to abort everything in flight and stop the thread.
    """

    def __init__(self, engine: Any, idle_poll_s: float = 0.5) -> None:
        self.engine = engine  # the LLMEngine; only the engine thread may call its methods
        self._idle_poll_s = idle_poll_s  # seconds the idle thread sleeps between checks of the stop flag
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listeners: list[StepListener] = []
        self._state = _Loop()
        self._stats: Any = None  # newest stats, published by the engine thread (reference swap is atomic)

    @classmethod
    def from_engine_args(cls, args: Any) -> "AsyncLLMEngine":
        """Build the LLMEngine from EngineArgs and start the engine thread."""
        from loom.engine.llm_engine import LLMEngine

        front = cls(LLMEngine.from_engine_args(args))
        front.start()
        return front

    # -- read-only facts about the model (immutable after construction, safe from any thread) --
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    @property
    def model_identity(self) -> Any:
        """The engine's ModelIdentity (loom/engine/model_identity.py; hashed on first use)."""
        return self.engine.model_identity

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def max_num_seqs(self) -> int | None:
        """Running seats (a beam search takes one per beam); None for an engine without a scheduler config."""
        config = getattr(getattr(self.engine, "scheduler", None), "scheduler_config", None)
        return getattr(config, "max_num_seqs", None)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def add_listener(self, listener: StepListener) -> None:
        """Register a step listener (call before serving; listeners run on the engine thread)."""
        self._listeners = [*self._listeners, listener]

    def get_stats(self) -> Any:
        """The newest EngineStats snapshot (None before the first one)."""
        return self._stats

    def check_prompt_chars(self, text: str, name: str = "prompt") -> None:
        """LLMEngine.check_prompt_chars: refuse a text too long to fit, before tokenizing it. Raises ValueError."""
        self.engine.check_prompt_chars(text, name)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (LLMEngine.tokenize: pure tokenizer work, any thread). Raises ValueError."""
        return list(self.engine.tokenize(prompt))

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint (LLMEngine.check_structured_output; pure and
        thread-safe: the compile cache is shared with the engine thread). Raises ValueError."""
        self.engine.check_structured_output(params)

    def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of the chat prompt (LLMEngine.apply_chat_template and its options). Pure tokenizer work.

        Raises whatever the template raises (jinja2 TemplateError for bad conversations), ValueError for options.
        """
        return list(self.engine.apply_chat_template(messages, **options))

    # -- lifecycle --
    def start(self) -> None:
        """Start the engine thread. Raises RuntimeError when already started.

        The calling thread (which built the engine, and so opened parallel regions loading it) hands back its
        OpenMP workers first: with two pools alive libgomp counts more threads than a small machine's CPUs and
        makes every barrier of the engine thread's steps sleep (loom/kernels/openmp.py).
        """
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="loom-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Ask the engine thread to stop after the current step (safe from signal handlers).

        It then aborts every request in flight (their streams end with finish_reason "abort").
        """
        self._stop.set()
        self._commands.put(_Abort(""))  # wakes the idle thread

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort every request in flight, free their KV blocks and stop the engine thread."""
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1f s", timeout_s)
                return
        self.engine.shutdown()  # the executor's workers (tensor parallel), after the last step

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result (tests, admin)."""
        self._check_running()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    # -- requests --
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> "RequestStream":
        """Submit one request; returns once the engine accepted it, with the stream of its outputs.

        `request_id` must be unique among requests in flight. Close the stream (`aclose`) when done
        with it: closing an unfinished stream aborts the request and frees its KV blocks.
        Raises ValueError (bad prompt or parameters, duplicate request_id), QueueFullError (waiting
        queue full), EngineDeadError (engine stopped). Nothing stays in the engine when it raises.
        `kv_transfer_params`: prefill/decode disaggregation (LLMEngine.add_request); a decode request's blocks are
        pulled here, in a worker thread, so the engine thread never waits on the network.
        """
        self._check_running()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # Tokenize here, in a worker thread (the tokenizer releases the GIL): a 20 MB prompt took ~20 s on the
        # engine thread and stalled every running request meanwhile.
        token_ids = await asyncio.to_thread(self.engine.tokenize, prompt) if isinstance(prompt, str) else None
        transfer, remote_kv = None, None
        if kv_transfer_params:
            transfer = self.engine.parse_kv_transfer(kv_transfer_params)
            if transfer is not None and transfer.remote is not None:
                ids = list(token_ids if token_ids is not None else prompt)
                remote_kv = await asyncio.to_thread(self.engine.pull_remote_kv, transfer, ids, params)
                transfer = type(transfer)(False, None)  # pulled (or failed): the engine thread must not pull
        self._check_running()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, token_ids, params, arrival, cache_salt, stream, done, transfer,
                                remote_kv))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._commands.put(_Abort(request_id, stream))  # in case the add still went through
            raise
        return RequestStream(self, request_id, stream)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its RequestOutputs until the one with finished=True.

        The request is aborted (KV blocks freed) if the consumer stops early; use
        `contextlib.aclosing` so that happens promptly. Raises what `add_request` raises, before
        the first output.
        """
        stream = await self.add_request(request_id, prompt, params, arrival_time, cache_salt, kv_transfer_params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (no-op for unknown ids). Its consumer gets a final "abort" output."""
        self._commands.put(_Abort(request_id))

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")

    # -- engine thread --
    def _run(self) -> None:
        state = self._state
        try:
            while not self._stop.is_set():
                self._drain(state, block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step(state)
                else:
                    on_idle = getattr(self.engine, "on_idle", None)  # e.g. free pulled or expired pinned KV blocks
                    if on_idle is not None:
                        on_idle()
                    self._publish(state, [])
        except BaseException:  # pragma: no cover - a bug in the loop itself; fail everyone loudly
            logger.exception("engine loop crashed")
            raise
        finally:
            self._stop.set()
            self._abort_all(state, "shutdown")
            self._fail_pending_commands()

    def _drain(self, state: _Loop, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(state, cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, state: _Loop, cmd: _Command) -> None:
        if isinstance(cmd, _Abort):
            stream = state.streams.get(cmd.request_id)
            if stream is not None and (cmd.stream is None or cmd.stream is stream):
                del state.streams[cmd.request_id]
                self.engine.abort_request([cmd.request_id])
                final = _final_output(cmd.request_id, stream, "abort")
                stream.put(final)
                self._notify([final])
            return
        if isinstance(cmd, _Call):
            if not cmd.done.set_running_or_notify_cancel():
                return
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                cmd.done.set_exception(e)
            return
        if not cmd.done.set_running_or_notify_cancel():
            return  # the caller gave up before we got to it
        if self._stop.is_set():
            cmd.done.set_exception(EngineDeadError("the engine is shutting down"))
            return
        if cmd.request_id in state.streams:
            cmd.done.set_exception(ValueError(f"request_id {cmd.request_id!r} is already in flight"))
            return
        try:
            transfer = {} if cmd.kv_transfer is None else {"kv_transfer_params": cmd.kv_transfer,
                                                           "remote_kv": cmd.remote_kv}
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    cache_salt=cmd.cache_salt, prompt_token_ids=cmd.prompt_token_ids, **transfer)
        except Exception as e:  # noqa: BLE001 - ValueError / QueueFullError / bugs: that request only
            cmd.done.set_exception(e)
            return
        state.streams[cmd.request_id] = cmd.stream
        cmd.done.set_result(None)

    def _step(self, state: _Loop) -> None:
        try:
            outputs = self.engine.step()
        except ExecutorDiedError:  # a tensor-parallel worker died: nothing can run any more
            logger.exception("the executor died; failing %d request(s) and stopping the engine", len(state.streams))
            self._abort_all(state, "error")
            self._stop.set()
            return
        except Exception:  # noqa: BLE001 - fail the requests of this step, keep serving the next ones
            logger.exception("engine step failed; failing %d request(s) in flight", len(state.streams))
            self._abort_all(state, "error")
            return
        # An aborted request's final output was already made and counted when it was aborted; the engine's
        # own abort output for it must not count twice.
        live = [out for out in outputs if out.request_id in state.streams]
        self._publish(state, live)  # metrics first: a client that sees its last token may read them at once
        for out in live:
            stream = state.streams[out.request_id]
            stream.last = out
            if out.finished:
                del state.streams[out.request_id]
            stream.put(out)

    def _publish(self, state: _Loop, outputs: Sequence[RequestOutput]) -> None:
        try:
            stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001 - stats must never stop serving
            logger.exception("get_stats failed")
            return
        self._stats = stats
        self._notify(outputs, stats)

    def _notify(self, outputs: Sequence[RequestOutput], stats: Any = None) -> None:
        now = time.monotonic()
        for listener in self._listeners:
            try:
                listener.on_step(outputs, stats, now)
            except Exception:  # noqa: BLE001
                logger.exception("step listener failed")

    def _abort_all(self, state: _Loop, reason: str) -> None:
        ids = list(state.streams)
        if not ids:
            return
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001
            logger.exception("abort_request failed while failing requests")
        finals = []
        for request_id in ids:
            stream = state.streams.pop(request_id)
            finals.append(_final_output(request_id, stream, reason))
            stream.put(finals[-1])
        self._notify(finals)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError("the engine is shutting down"))


class RequestStream:
    """Async iterator over one request's RequestOutputs; the last one has finished=True.

    An output with finish_reason "abort" or "error" ends it when the request was aborted or the
    engine failed while serving it.
    """

    def __init__(self, front: AsyncLLMEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id  # engine-unique id
        self._front = front
        self._stream = stream
        self._finished = False  # the final output was handed out (or the stream was closed)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):  # pragma: no cover - the engine thread sends outputs only
            self._finished = True
            raise item
        if item.finished:
            self._finished = True
        return item

    def close(self) -> None:
        """Abort the request if it has not finished (safe to call more than once, from any coroutine)."""
        if not self._finished:
            self._finished = True
            self._front._commands.put(_Abort(self.request_id, self._stream))

    async def aclose(self) -> None:
        self.close()


def _final_output(request_id: str, stream: _Stream, reason: str) -> RequestOutput:
    """A finished RequestOutput for a request the engine dropped ("abort", "error", "shutdown")."""
    finish = "abort" if reason == "shutdown" else reason
    last = stream.last
    outputs = []
    for i in range(stream.n):
        prev = last.outputs[i] if last is not None and i < len(last.outputs) else None
        outputs.append(CompletionOutput(
            index=i,
            text=prev.text if prev else "",
            token_ids=list(prev.token_ids) if prev else [],
            cumulative_logprob=prev.cumulative_logprob if prev else None,
            logprobs=prev.logprobs if prev else None,
            finish_reason=prev.finish_reason if prev and prev.finish_reason else finish,
            stop_reason=prev.stop_reason if prev else None,
        ))
    return RequestOutput(
        request_id=request_id,
        prompt=last.prompt if last else None,
        prompt_token_ids=list(last.prompt_token_ids) if last else [],
        prompt_logprobs=last.prompt_logprobs if last else None,
        outputs=outputs,
        finished=True,
        num_cached_tokens=last.num_cached_tokens if last else 0,
        metrics=last.metrics if last else None,
    )


__all__ = ["AsyncLLMEngine", "EngineDeadError", "QueueFullError", "StepListener"]
