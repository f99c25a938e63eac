"""Every request rule on the real model: stops, EOS, min/max tokens, tiny top_p, bad requests."""

from __future__ import annotations

import pytest

from loom import LLM, SamplingParams
from loom.request import RequestStatus

PROMPT = "Write one sentence about the moon."


@pytest.fixture(scope="module")
def chat_prompt(llm: LLM) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": PROMPT}])


@pytest.fixture(scope="module")
def free_run(llm: LLM, chat_prompt: list[int]):
    """The unconstrained greedy continuation, used to pick stop strings that must occur."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return llm.generate([chat_prompt], params, use_tqdm=False)[0].outputs[0]


def _token_texts(llm: LLM, token_ids: list[int]) -> list[str]:
    # Text contributed by each token, from cumulative decodes (robust to multi-token characters).
    texts, prev = [], ""
    for i in range(1, len(token_ids) + 1):
        cur = llm.tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        texts.append(cur[len(prev):])
        prev = cur
    return texts


def _stop_run(llm: LLM, prompt: list[int], stop: str, **kw) -> object:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=2, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_stop_string_inside_one_token(llm: LLM, chat_prompt, free_run) -> None:
    texts = _token_texts(llm, free_run.token_ids)
    k, piece = next((i, t) for i, t in enumerate(texts) if i > 0 and len(t.strip()) >= 3)
    stop = piece.strip()[1:3]  # strictly inside the token's text
    out = _stop_run(llm, chat_prompt, stop)
    expected = free_run.text[: free_run.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected
    assert len(out.logprobs) == len(out.token_ids)


def test_stop_string_across_three_tokens(llm: LLM, chat_prompt, free_run) -> None:
    texts = _token_texts(llm, free_run.token_ids)
    k = next(i for i in range(2, len(texts) - 3) if all(texts[i + j] for j in range(3)))
    stop = texts[k][-1] + texts[k + 1] + texts[k + 2][:1]  # last char of one, all of the next, first of a third
    out = _stop_run(llm, chat_prompt, stop)
    cut = free_run.text.index(stop)
    assert out.text == free_run.text[:cut]
    assert out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids) <= k + 3


def test_stop_string_on_the_first_token_with_logprobs(llm: LLM, chat_prompt, free_run) -> None:
    first = _token_texts(llm, free_run.token_ids)[0]
    out = _stop_run(llm, chat_prompt, first)
    assert out.text == ""
    assert out.finish_reason == "stop"
    assert len(out.token_ids) == 1 and len(out.logprobs) == 1


def test_include_stop_str_in_output(llm: LLM, chat_prompt, free_run) -> None:
    texts = _token_texts(llm, free_run.token_ids)
    stop = texts[3]
    out = _stop_run(llm, chat_prompt, stop, include_stop_str_in_output=True)
    assert out.text == free_run.text[: free_run.text.index(stop) + len(stop)]


def test_early_eos_ignore_eos_and_min_tokens(llm: LLM) -> None:
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Reply with just the word yes."}])
    natural = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop"  # the model ends its short answer with EOS
    n = len(natural.token_ids)
    assert n < 40
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 40
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n + 5),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= n + 5
    assert held.token_ids[: n - 1] == natural.token_ids[: n - 1]  # same text until the held-back stop


def test_very_small_top_p_is_greedy(llm: LLM, chat_prompt, free_run) -> None:
    params = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=24, ignore_eos=True, seed=3)
    assert llm.generate([chat_prompt], params, use_tqdm=False)[0].outputs[0].token_ids == free_run.token_ids


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_max_tokens_zero_and_one(llm: LLM, chat_prompt, free_run, max_tokens: int) -> None:
    out = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run.token_ids[:max_tokens]
    assert out.finish_reason == "length"


def test_prompt_logprobs_cover_every_prompt_token(llm: LLM, chat_prompt) -> None:
    out = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(chat_prompt)
    assert out.prompt_logprobs[0] is None
    for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert chat_prompt[pos] in lp
        assert 1 <= len(lp) <= 4


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_too_long_prompt_next_to_normal_requests(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("ok-1", "Hello there", SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", [1] * (engine.max_model_len + 1), SamplingParams(max_tokens=4))
    engine.add_request("ok-2", "Good morning", SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {"ok-1": "length", "ok-2": "length"}


def test_out_of_vocabulary_token_id_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, llm.engine.vocab_size]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_invalid_sampling_values_name_the_parameter() -> None:
    for kwargs, name in [({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature"), ({"n": 0}, "n"),
                         ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                         ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                         # a number or a string where a list goes: not a TypeError from list(), nor a message
                         # about one character of the string
                         ({"stop": 5}, "stop must be a string or a list of strings"),
                         ({"stop_token_ids": "2"}, "stop_token_ids must be a list of integers")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_sampling_params_as_a_dict_is_named_as_such(llm: LLM) -> None:
    """A dict of fields was read as its keys: 'must be a SamplingParams, got str'."""
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of one per prompt, "
                                         "got dict"):
        llm.generate(["hi"], {"temperature": 0}, use_tqdm=False)


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", "Tell me a long story", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["to-abort"])
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert engine.scheduler.get_request("to-abort") is None or \
        engine.scheduler.get_request("to-abort").status == RequestStatus.FINISHED_ABORTED


def test_capital_of_france_answers_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_prompt_filling_max_model_len_names_its_length(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match=f"prompt of {engine.max_model_len} tokens leaves no room"):
        engine.add_request("full", [1] * engine.max_model_len, SamplingParams(max_tokens=4))
    engine.add_request("full-0", [1] * engine.max_model_len, SamplingParams(max_tokens=0))  # prompt only: fits
    engine.abort_request(["full-0"])


def test_generate_rejects_a_non_list_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(None)  # type: ignore[arg-type]


def test_boolean_and_container_fields_are_type_checked() -> None:
    for kwargs, name in [({"ignore_eos": "no"}, "ignore_eos"), ({"skip_special_tokens": 1}, "skip_special_tokens"),
                         ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
                         ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {"a": 1}}, "token ids"),
                         ({"logit_bias": {-1: 5.0}}, "token ids >= 0")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_params_changed_after_construction_are_checked_again(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2)
    params.temperature = -3
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", params, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("hi", "x", use_tqdm=False)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_chat_checks_messages_like_the_server(llm: LLM) -> None:
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        llm.chat([{"role": "bogus", "content": "hi"}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\].content"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}], params, use_tqdm=False)
    for missing in ({"role": "user"}, {"role": "system", "content": None}):  # the server answers 400 to both
        with pytest.raises(ValueError, match=r"messages\[0\].content is required"):
            llm.chat([missing, {"role": "user", "content": "hi"}], params, use_tqdm=False)
    # an assistant turn may leave its content out (it may have carried tool calls): it is then ""
    out = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "and?"}],
                   params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    # text content parts are joined, as the server joins them; other parts are refused
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert (llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == llm.chat([{"role": "user", "content": "Say hi"}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_request_with_n_copies_counts_once_against_the_waiting_queue() -> None:
    """max_waiting_requests=1: a request with n=3 queues behind a running one (its copies are one user
    request), a second user request is refused, and every block comes back."""
    from loom.core.scheduler import QueueFullError
    from loom.engine.llm_engine import LLMEngine
    from loom.config import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(max_waiting_requests=1, max_num_seqs=1, max_model_len=256))
    params = SamplingParams(temperature=0.0, max_tokens=20)
    engine.add_request("a", "Hello", params)
    engine.step()  # a takes the only seat
    engine.add_request("b", "Hello there", SamplingParams(temperature=0.8, max_tokens=4, n=3, seed=1))
    with pytest.raises(QueueFullError):
        engine.add_request("c", "Hi", params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"a", "b"} and len(finished["b"].outputs) == 3
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(llm: LLM, monkeypatch) -> None:
    """The work a request may cause is bounded by what it may use: a text longer than max_model_len times the
    longest token's characters is refused without running the tokenizer or the template on it."""
    engine = llm.engine
    too_long = "x" * (engine.max_prompt_chars + 1)
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or "")
    with pytest.raises(ValueError, match=r"^prompt of \d+ characters cannot fit max_model_len"):
        engine.add_request("long", too_long, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"^messages of \d+ characters cannot fit"):
        engine.apply_chat_template([{"role": "user", "content": too_long}])
    assert not calls and not engine.has_unfinished_requests()
    assert engine.max_prompt_chars >= engine.max_model_len  # the bound never refuses a prompt that fits


def test_a_prompt_that_is_not_valid_unicode_is_refused_naming_it(llm: LLM) -> None:
    """A lone surrogate (a \\ud800 escape, or a byte that is not UTF-8 in argv) cannot be encoded by any tokenizer:
    the engine refuses it by name before tokenizing (it raised the tokenizer's TypeError from inside), and the
    request is not added."""
    engine = llm.engine
    with pytest.raises(ValueError, match=r"^prompt is not valid Unicode: a lone surrogate U\+D800 at character 2$"):
        engine.add_request("bad", "ab\ud800", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"^messages is not valid Unicode: a lone surrogate U\+DCFF at character 0 "):
        engine.apply_chat_template([{"role": "user", "content": "\udcff"}])
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["\ud800"], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_chat_template_options_on_the_real_template(llm: LLM) -> None:
    """continue_final_message leaves the assistant turn open (no end token, no new header); without the
    generation prompt the text ends after the last message; reserved template arguments are refused."""
    engine = llm.engine
    tok = engine.tokenizer
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    cont = tok.decode(engine.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True))
    assert cont.endswith("The color is")
    closed = tok.decode(engine.apply_chat_template(conv, add_generation_prompt=False))
    assert closed.rstrip().endswith("<|im_end|>")
    opened = tok.decode(engine.apply_chat_template(conv[:1]))
    assert opened.rstrip().endswith("assistant")
    out = llm.chat([conv], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert out.outputs[0].text and not out.outputs[0].text.startswith("<|im_start|>")
    with pytest.raises(ValueError, match="add_generation_prompt false"):
        engine.apply_chat_template(conv, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant turn"):
        engine.apply_chat_template(conv[:1], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set"):
        engine.apply_chat_template(conv[:1], chat_template_kwargs={"tokenize": True})
    assert engine.apply_chat_template(conv[:1], chat_template_kwargs={"custom_var": 1}) == engine.apply_chat_template(
        conv[:1])  # a variable this template does not read changes nothing


def test_prompt_logprobs_are_computed_once_for_n_copies(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=2, prompt_logprobs=1)
    engine.add_request("plp", "One two three four", params)
    children = [engine.scheduler.requests[f"{i}_plp"] for i in range(3)]
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and len(final.outputs) == 3
    assert final.prompt_logprobs[0] is None and all(e for e in final.prompt_logprobs[1:])
    assert len(final.prompt_logprobs) == len(final.prompt_token_ids)
