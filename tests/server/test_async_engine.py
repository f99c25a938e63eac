"""AsyncLLMEngine over the fake engine: ordering, early exit, errors, step failures, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from loom.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from tests.server.conftest import make_fake_front, wait_for
from tests.server.fake_engine import FakeEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


T = TypeVar("T")
Front = tuple[AsyncLLMEngine, FakeEngine]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture()
def front() -> Iterator[Front]:
    eng, fake = make_fake_front(max_waiting_requests=2, max_num_seqs=2)
    yield eng, fake
    eng.shutdown()


def test_generate_yields_until_finished(front: Front) -> None:
    eng, fake = front

    async def go() -> list[RequestOutput]:
        return [o async for o in eng.generate("a", "hello", GREEDY)]

    outs = run(go())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(outs[-1].outputs[0].token_ids) == 5
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert not fake.reqs


def test_consumer_leaving_early_aborts_and_frees(front: Front) -> None:
    eng, fake = front
    fake.step_delay_s = 0.01

    async def go() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200)
        async with contextlib.aclosing(eng.generate("a", "hello", params)) as gen:
            async for _ in gen:
                break

    run(go())
    assert wait_for(lambda: not fake.reqs, 5)
    assert wait_for(lambda: eng.get_stats() is not None and eng.get_stats().num_free_blocks == fake.num_kv_blocks, 5)


def test_cancelled_consumer_aborts(front: Front) -> None:
    eng, fake = front
    fake.step_delay_s = 0.01

    async def consume() -> None:
        async for _ in eng.generate("a", "hello", SamplingParams(max_tokens=500)):
            pass

    async def go() -> None:
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(go())
    assert wait_for(lambda: not fake.reqs, 5)


def test_add_errors_reach_the_caller_and_leave_nothing(front: Front) -> None:
    eng, fake = front

    async def first(rid: str, prompt: str | list[int], params: SamplingParams = GREEDY) -> RequestOutput | None:
        async for out in eng.generate(rid, prompt, params):
            return out
        return None

    with pytest.raises(ValueError, match="too long"):
        run(first("x", "a" * 400))
    with pytest.raises(ValueError, match="vocabulary"):
        run(first("y", [10_000]))
    assert not fake.reqs


def test_queue_full_raises_queue_full_error(front: Front) -> None:
    eng, fake = front
    fake.step_delay_s = 0.05
    long = SamplingParams(max_tokens=1000)

    async def go() -> None:
        streams = [await eng.add_request(f"r{i}", "hi", long) for i in range(2)]  # 2 waiting (queue bound 2)
        try:
            with pytest.raises(QueueFullError):
                for i in range(2, 6):
                    streams.append(await eng.add_request(f"r{i}", "hi", long))
        finally:
            for s in streams:
                s.close()

    run(go())
    assert wait_for(lambda: not fake.reqs, 5)


def test_duplicate_in_flight_id_is_refused_without_disturbing_the_first(front: Front) -> None:
    eng, fake = front
    fake.step_delay_s = 0.005

    async def go() -> None:
        s1 = await eng.add_request("same", "hello", GREEDY)
        with pytest.raises(ValueError, match="already"):
            await eng.add_request("same", "hello", GREEDY)
        outs = [o async for o in s1]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"

    run(go())


def test_step_failure_fails_requests_in_flight_and_keeps_serving(front: Front) -> None:
    eng, fake = front
    fake.step_delay_s = 0.01

    async def go() -> None:
        stream = await eng.add_request("a", "hello", SamplingParams(max_tokens=100))
        fake.fail_next_step = True
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
        after = [o async for o in eng.generate("b", "hello", GREEDY)]
        assert after[-1].outputs[0].finish_reason == "length"

    run(go())
    assert eng.is_running and not fake.reqs


def test_shutdown_aborts_in_flight_and_refuses_new() -> None:
    eng, fake = make_fake_front(step_delay_s=0.01)

    async def go() -> None:
        stream = await eng.add_request("a", "hello", SamplingParams(max_tokens=1000))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await eng.add_request("b", "hello", GREEDY)

    run(go())
    assert not fake.reqs


def test_call_runs_on_the_engine_thread(front: Front) -> None:
    eng, _ = front
    import threading

    name = run(eng.call(lambda _e: threading.current_thread().name))
    assert name == "loom-engine"


def test_start_twice_is_an_error(front: Front) -> None:
    eng, _ = front
    with pytest.raises(RuntimeError):
        eng.start()


def test_not_started_engine_refuses_requests() -> None:
    eng = AsyncLLMEngine(FakeEngine())

    async def go() -> None:
        await eng.add_request("a", "hi", GREEDY)

    with pytest.raises(EngineDeadError):
        run(go())


def test_a_slow_tokenization_does_not_stall_running_requests(front: Front) -> None:
    """Text prompts are tokenized in a worker thread, not on the engine thread between steps."""
    eng, fake = front
    fake.step_delay_s = 0.01
    encode = fake.tokenizer.encode

    def slow_encode(text: str) -> list[int]:
        if text == "huge":
            import time
            time.sleep(1.0)  # stands in for a 20 MB prompt (the real tokenizer releases the GIL too)
        return encode(text)

    fake.tokenizer.encode = slow_encode

    async def go() -> int:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        running = asyncio.create_task(eng.add_request("run", [5, 6, 7], params))
        stream = await running
        huge = asyncio.create_task(eng.add_request("huge", "huge", GREEDY))
        outputs_while_tokenizing = 0
        async for _ in stream:
            if not huge.done():
                outputs_while_tokenizing += 1
        await (await huge).aclose()
        return outputs_while_tokenizing

    assert run(go()) >= 20  # the running request kept stepping (~10 ms a step) during the 1 s tokenization
