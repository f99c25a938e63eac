"""OutputProcessor with the real SmolLM2 tokenizer and hand-made engine-core outputs."""

from __future__ import annotations

import random

import pytest

from loom.core.sched_output import EngineCoreOutput, TokenLogprobs
from loom.engine.output_processor import OutputProcessor, find_stop_string, held_back_len
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams

PROMPT = "Tell me a story."


def add(proc: OutputProcessor, tok, params: SamplingParams, parent: str = "p") -> list[str]:
    prompt_ids = tok.encode(PROMPT)
    ids = [parent] if params.n == 1 else [f"{i}_{parent}" for i in range(params.n)]
    for i, child in enumerate(ids):
        proc.add_request(child, parent, i, params.n, PROMPT, prompt_ids, params, arrival_time=1.0)
    return ids


def fake_logprobs(token_id: int, step: int) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[token_id, 5], logprobs=[-0.5 - step, -0.1], ranks=[2, 1])


def feed(proc: OutputProcessor, child: str, ids: list[int], logprobs: bool = False, **finish: object) -> list[RequestOutput]:
    """One token per step; `finish` (finish_reason / stop_reason) goes on the last step."""
    results = []
    for k, token_id in enumerate(ids):
        extra = finish if k == len(ids) - 1 else {}
        out = EngineCoreOutput(child, [token_id], [fake_logprobs(token_id, k)] if logprobs else None, **extra)
        results += proc.process_outputs([out]).request_outputs
    return results


def joined_deltas(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(o.outputs[index].delta_text for o in outputs)


def test_stop_string_inside_one_token(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop=["orl"], max_tokens=50))
    ids = hf_tokenizer.encode("Hello world again", add_special_tokens=False)
    processed = proc.process_outputs([EngineCoreOutput(child, ids[:2])])
    assert processed.reqs_to_abort == [child]
    (out,) = processed.request_outputs
    c = out.outputs[0]
    assert out.finished and c.text == "Hello w" and c.finish_reason == "stop" and c.stop_reason == "orl"
    assert c.token_ids == ids[:2]
    assert proc.process_outputs([EngineCoreOutput(child, ids[2:])]).request_outputs == []  # finished: silent
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_three_tokens_with_logprobs(hf_tokenizer, include: bool) -> None:
    proc = OutputProcessor(hf_tokenizer)
    params = SamplingParams(stop=["ick brown f"], logprobs=1, include_stop_str_in_output=include, max_tokens=50)
    (child,) = add(proc, hf_tokenizer, params)
    ids = hf_tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    outputs = feed(proc, child, ids, logprobs=True)
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished
    assert final.text == ("The quick brown f" if include else "The qu")
    assert joined_deltas(outputs) == final.text
    fox = ids.index(hf_tokenizer.encode(" fox", add_special_tokens=False)[0])
    assert final.token_ids == ids[: fox + 1]
    assert len(final.logprobs) == len(final.token_ids)
    assert final.cumulative_logprob == pytest.approx(sum(-0.5 - k for k in range(fox + 1)))
    assert final.logprobs[0][ids[0]].decoded_token == "The" and final.logprobs[0][5].rank == 1


def test_stop_string_on_first_token(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop=["Hel"], logprobs=0))
    ids = hf_tokenizer.encode("Hello there", add_special_tokens=False)
    processed = proc.process_outputs([EngineCoreOutput(child, ids, [fake_logprobs(t, 0) for t in ids])])
    c = processed.request_outputs[0].outputs[0]
    assert c.text == "" and c.token_ids == ids[:1] and len(c.logprobs) == 1 and c.delta_token_ids == ids[:1]
    assert processed.reqs_to_abort == [child]


def test_partial_match_is_held_back_then_released(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop=["brown cow"], max_tokens=4))
    ids = hf_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert len(ids) == 4
    outputs = feed(proc, child, ids, finish_reason="length")
    shown = [o.outputs[0].text for o in outputs]
    assert shown[2] == "The quick "  # "brown" could still become "brown cow"
    assert shown[3] == "The quick brown fox" and outputs[3].outputs[0].delta_text == "brown fox"
    assert outputs[3].outputs[0].finish_reason == "length"


def test_held_back_text_flushed_at_finish(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop=["brown cow"], max_tokens=3))
    ids = hf_tokenizer.encode("The quick brown", add_special_tokens=False)
    outputs = feed(proc, child, ids, finish_reason="length")
    assert outputs[-1].outputs[0].text == "The quick brown" == joined_deltas(outputs)


def test_min_tokens_suppresses_stop_strings(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop=["quick"], min_tokens=3, max_tokens=4))
    ids = hf_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    outputs = feed(proc, child, ids, finish_reason="length")
    assert outputs[-1].outputs[0].text == "The quick brown fox"
    assert all(not o.finished for o in outputs[:-1])


def test_eos_and_stop_token_text_not_shown(hf_tokenizer) -> None:
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = hf_tokenizer.encode("Hi there", add_special_tokens=False)
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(skip_special_tokens=False))
    outputs = feed(proc, child, ids + [eos], finish_reason="stop", stop_reason=None)
    final = outputs[-1].outputs[0]
    assert final.text == "Hi there" == joined_deltas(outputs) and final.token_ids == ids + [eos]
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(stop_token_ids=[ids[-1]]))
    outputs = feed(proc, child, ids, finish_reason="stop", stop_reason=ids[-1])
    assert outputs[-1].outputs[0].text == "Hi" and outputs[-1].outputs[0].stop_reason == ids[-1]


def test_n_children_fan_in(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    children = add(proc, hf_tokenizer, SamplingParams(n=2, max_tokens=3), parent="req")
    assert children == ["0_req", "1_req"] == proc.get_child_ids("req")
    a = hf_tokenizer.encode("One two three", add_special_tokens=False)
    b = hf_tokenizer.encode("Four five", add_special_tokens=False)
    step1 = proc.process_outputs([EngineCoreOutput("1_req", b[:1]), EngineCoreOutput("0_req", a[:1])])
    (out,) = step1.request_outputs
    assert out.request_id == "req" and [c.index for c in out.outputs] == [0, 1] and not out.finished
    step2 = proc.process_outputs([EngineCoreOutput("1_req", b[1:], finish_reason="length")])
    (out,) = step2.request_outputs  # news from one child is enough
    assert out.outputs[1].finished and not out.finished
    assert out.outputs[0].delta_text == "" and out.outputs[0].text == "One"
    step3 = proc.process_outputs([EngineCoreOutput("0_req", a[1:], finish_reason="length")])
    (out,) = step3.request_outputs
    assert out.finished and [c.text for c in out.outputs] == ["One two three", "Four five"]
    assert out.metrics.first_token_time <= out.metrics.last_token_time <= out.metrics.finished_time
    assert not proc.has_unfinished_requests()


def test_abort_produces_final_output_once(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    children = add(proc, hf_tokenizer, SamplingParams(n=2), parent="x")
    proc.process_outputs([EngineCoreOutput("0_x", [42], finish_reason="length")])
    assert proc.abort_request("x") == ["1_x"]
    assert proc.abort_request("x") == [] and not proc.has_unfinished_requests()
    (final,) = proc.process_outputs([EngineCoreOutput(children[1], [43])]).request_outputs
    assert final.finished and [c.finish_reason for c in final.outputs] == ["length", "abort"]
    assert final.outputs[1].token_ids == []
    assert proc.process_outputs([]).request_outputs == []


def test_prompt_logprobs_over_chunks(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    (child,) = add(proc, hf_tokenizer, SamplingParams(prompt_logprobs=1))
    prompt_ids = hf_tokenizer.encode(PROMPT)
    entries = [TokenLogprobs([t, 7], [-1.0, -0.5], [3, 1]) for t in prompt_ids[1:]]
    first = proc.process_outputs([EngineCoreOutput(child, [], new_prompt_logprobs=entries[:2])])
    assert first.request_outputs[0].prompt_logprobs[0] is None
    assert len(first.request_outputs[0].prompt_logprobs) == 3
    last = proc.process_outputs([EngineCoreOutput(child, [11], new_prompt_logprobs=entries[2:])])
    plp = last.request_outputs[0].prompt_logprobs
    assert len(plp) == len(prompt_ids)
    assert [next(iter(d)) for d in plp[1:]] == prompt_ids[1:]


def test_duplicate_request_id_rejected(hf_tokenizer) -> None:
    proc = OutputProcessor(hf_tokenizer)
    add(proc, hf_tokenizer, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        add(proc, hf_tokenizer, SamplingParams())


def test_random_chunking_deltas_join_to_final_text(hf_tokenizer) -> None:
    rng = random.Random(1)
    sentences = ["The cat sat on the mat, and then the dog barked twice at the mailman.",
                 "Ünïcödé wörds — 日本語 and emoji 😀 mixed in here, stop STOP stop."]
    for trial in range(20):
        text = rng.choice(sentences)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        start = rng.randrange(len(text) - 4)
        stop = text[start : start + rng.randrange(1, 5)]
        proc = OutputProcessor(hf_tokenizer)
        (child,) = add(proc, hf_tokenizer, SamplingParams(stop=[stop, "zzz"], max_tokens=len(ids)))
        outputs: list[RequestOutput] = []
        pos = 0
        while pos < len(ids) and not (outputs and outputs[-1].finished):
            size = rng.randrange(1, 4)
            chunk = ids[pos : pos + size]
            pos += size
            finish = {"finish_reason": "length"} if pos >= len(ids) else {}
            outputs += proc.process_outputs([EngineCoreOutput(child, chunk, **finish)]).request_outputs
        final = outputs[-1].outputs[0]
        assert outputs[-1].finished and final.finish_reason == "stop" and final.stop_reason in (stop, "zzz")
        assert joined_deltas(outputs) == final.text == text[: text.find(stop)], (trial, stop)
        assert "\ufffd" not in final.text
        assert hf_tokenizer.decode(final.token_ids).find(stop) != -1  # the completing token is kept


def test_find_stop_and_hold_back_helpers() -> None:
    assert find_stop_string("abcxyz", 4, ["xy", "b"]) == (3, "xy")  # "b" ended before the new text
    assert find_stop_string("abcxyz", 2, ["yz", "cx"]) == (2, "cx")  # earliest start wins
    assert find_stop_string("abc", 0, ["d"]) is None
    assert held_back_len("hello wor", ["world", "or not"]) == 3
    assert held_back_len("hello", ["xyz"]) == 0


def test_record_scheduled_keeps_the_first_time(hf_tokenizer) -> None:
    from loom.engine.output_processor import OutputProcessor
    from loom.sampling_params import SamplingParams

    proc = OutputProcessor(hf_tokenizer)
    proc.add_request(request_id="a", parent_id="a", index=0, n=1, prompt=None, prompt_token_ids=[1, 2],
                     params=SamplingParams(), arrival_time=10.0)
    proc.record_scheduled(["a", "unknown"], 11.0)
    proc.record_scheduled(["a"], 12.0)  # e.g. resumed after a preemption
    assert proc._parents["a"].metrics.first_scheduled_time == 11.0
