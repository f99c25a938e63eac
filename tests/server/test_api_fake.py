"""The HTTP layer against the fake engine on a live 127.0.0.1 server: errors, streaming, lifecycle, metrics."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import LiveServer, make_fake_front, serve, wait_for
from tests.server.fuzz_bodies import chat_bodies, completion_bodies, resolve_model

CHAT = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1_000_000}, "n"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": [5, 100_000]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a" * 300}, "prompt"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\u0663": 1}}, "logit_bias"),  # ARABIC-INDIC DIGIT THREE: int() reads 3
    ({"prompt": "x", "logit_bias": {" 3_0 ": 1}}, "logit_bias"),  # int() reads 30
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**80}, "seed"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": 2}, "prompt"),
])
def test_completion_bad_input_is_400_naming_the_param(client: httpx.Client, body: dict, param: str) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),  # only an assistant turn may omit its content
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_bad_input_is_400_naming_the_param(client: httpx.Client, body: dict, param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path,body,param,shapes", [
    *[("/v1/completions", {"prompt": p}, "prompt", "a string, a list of strings, a list of token ids (integers) or a "
       "list of lists of token ids") for p in (["a", 1], 5, [[1], "a"], [[1, "x"]], [1.5], [True], {"text": "a"})],
    *[("/v1/completions", {"prompt": "x", "stop": s}, "stop", "a string or a list of strings") for s in (5, ["a", 1])],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     'a string, a list of content parts ({"type": "text", "text": ...}) or null'),
])
def test_a_value_of_no_accepted_shape_names_the_shapes(client: httpx.Client, path: str, body: dict, param: str,
                                                       shapes: str) -> None:
    """A union's error named one branch of it as if the value had to be that: `"prompt": ["a", 1]` got
    "prompt.str: Input should be a valid string"."""
    r = client.post(path, json=body)
    assert_error(r, 400, param)
    message = r.json()["error"]["message"]
    assert message.endswith(f": must be {shapes}") and message.split(":")[0].split(".")[0] == param, message
    assert ".str" not in message


def test_malformed_json_unknown_model_and_routes(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400, None)
    r = client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                    headers={"content-type": "application/json"})
    assert_error(r, 400, "temperature")
    assert_error(client.post("/v1/completions", json=["x"]), 400, None)
    # JSON that Python's json module refuses: FastAPI's answer said only "There was an error parsing the body"
    for raw, reason in ((b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", "digits"),
                        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply")):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, None)
        assert reason in r.json()["error"]["message"]
    assert_error(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-5"}), 404, "model")
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_without_a_json_content_type_is_415_saying_so(client: httpx.Client, path: str,
                                                             content_type: str | None) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: FastAPI then does not parse the body, and the answer
    was "body: Input should be a valid dictionary or object to extract fields from"."""
    body = json.dumps({"messages": CHAT, "max_tokens": 2} if "chat" in path else
                      {"prompt": "x"} if path == "/tokenize" else {"prompt": "x", "max_tokens": 2}).encode()
    r = client.post(path, content=body, headers={} if content_type is None else {"content-type": content_type})
    assert_error(r, 415, None)
    message = r.json()["error"]["message"]
    assert "must be JSON" in message and "Content-Type: application/json" in message, message
    assert (content_type or "no Content-Type") in message
    assert ("curl -d" in message) == (content_type == "application/x-www-form-urlencoded")
    r = client.post(path, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text  # the same bytes as JSON


def test_a_body_that_is_no_json_object_or_empty_says_so(client: httpx.Client) -> None:
    for body, words in ((["x"], "must be a JSON object, not a JSON array"), ("x", "not a JSON string"),
                        (3, "not a JSON number")):
        r = client.post("/v1/completions", json=body)
        assert_error(r, 400, None)
        assert words in r.json()["error"]["message"]
    r = client.post("/v1/completions", headers={"content-type": "application/json"})
    assert_error(r, 400, None)
    assert r.json()["error"]["message"].startswith("The request body is empty")


def test_completion_echo_logprobs_usage_and_clamped_inf(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3, "echo": True, "logprobs": 2,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"].startswith("hey") and len(choice["text"]) == 6
    lp = choice["logprobs"]
    assert lp["tokens"][:3] == ["h", "e", "y"] and lp["token_logprobs"][0] is None
    assert -9999.0 in lp["top_logprobs"][3].values()  # the fake's -inf, clamped
    assert lp["text_offset"] == list(range(6))
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_multiple_prompts_and_n_index_choices(client: httpx.Client) -> None:
    for prompt in (["ab", "cde"], [[70, 71], [72, 73, 74]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 2, "seed": 3})
        choices = r.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["usage"]["prompt_tokens"] == 5
    assert_error(client.post("/v1/completions", json={"prompt": ["ab", [70, 71]]}), 400, "prompt")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 1,
                         "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 6, "temperature": 0.8, "seed": 5,
                              "logprobs": True, "top_logprobs": 1}),
])
def test_streamed_equals_non_streamed(client: httpx.Client, path: str, body: dict) -> None:
    full = client.post(path, json=body).json()
    events = sse_events(client.post(path, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}).text)
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage == full["usage"]
    assert all("usage" in ev and ev["usage"] is None for ev in events[:-1])  # null until the last chunk
    plain = sse_events(client.post(path, json={**body, "stream": True}).text)
    assert not any("usage" in ev for ev in plain)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ev in events[:-1]:
        for ch in ev["choices"]:
            piece = ch["text"] if "text" in ch else ch["delta"].get("content", "")
            texts[ch["index"]] = texts.get(ch["index"], "") + piece
            if ch["finish_reason"]:
                assert ch["index"] not in finish
                finish[ch["index"]] = ch["finish_reason"]
    for ch in full["choices"]:
        text = ch["text"] if "text" in ch else ch["message"]["content"]
        assert texts[ch["index"]] == text
        assert finish[ch["index"]] == ch["finish_reason"]


def test_stop_string_finish_reason(client: httpx.Client) -> None:
    full = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 20, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[3:5]
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 20, "temperature": 0, "stop": [stop]})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == text[: text.index(stop)]


def test_tokenize_detokenize_models(client: httpx.Client, fake_server: LiveServer) -> None:
    toks = client.post("/tokenize", json={"prompt": "hé"}).json()
    assert toks["count"] == 3
    assert client.post("/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "hé"
    assert client.post("/tokenize", json={"messages": CHAT}).json()["count"] > 3
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"


def test_metrics_exposition(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert f'loom:{name}{{model_name="fake-model"}}' in text, name
    assert 'loom:request_success_total{finished_reason="length",model_name="fake-model"}' in text


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_running_or_queued_aborts_and_frees(stream: bool) -> None:
    front, fake = make_fake_front(step_delay_s=0.01, max_num_seqs=1)
    with serve(front) as live:
        port = int(live.base_url.rsplit(":", 1)[1])
        body = {"prompt": "hello", "max_tokens": 200, "stream": stream}
        running = _raw_post(port, "/v1/completions", body)
        assert wait_for(lambda: any(r.running for r in list(fake.reqs.values())), 5)
        queued = _raw_post(port, "/v1/completions", body)
        assert wait_for(lambda: len(fake.reqs) == 2, 5)
        queued.close()
        assert wait_for(lambda: len(fake.reqs) == 1, 2)  # the queued one is gone, the running one goes on
        running.close()
        assert wait_for(lambda: not fake.reqs, 2)
        stats = front.get_stats()
        assert wait_for(lambda: front.get_stats().num_free_blocks == fake.num_kv_blocks, 2), stats
        with httpx.Client(base_url=live.base_url) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_full_queue_answers_503_with_retry_after() -> None:
    front, fake = make_fake_front(step_delay_s=0.02, max_num_seqs=1, max_waiting_requests=1)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=10) as c:
        port = int(live.base_url.rsplit(":", 1)[1])
        socks = [_raw_post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 200})]
        assert wait_for(lambda: any(r.running for r in list(fake.reqs.values())), 5)
        socks.append(_raw_post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 200}))
        assert wait_for(lambda: len(fake.reqs) == 2, 5)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_error(r, 503, None)
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        for s in socks:
            s.close()
        assert wait_for(lambda: not fake.reqs, 3)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_engine_step_failure_fails_only_that_request() -> None:
    front, fake = make_fake_front(step_delay_s=0.01)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=10) as c:
        fake.fail_next_step = True
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        assert_error(r, 500, None)
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            fake.fail_next_step = True  # mid-stream: the stream says why before [DONE]
            events = [line[6:] for line in c.post(path, json={**body, "max_tokens": 50, "stream": True}).text
                      .split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error", events


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(completion=completion_bodies(), chat=chat_bodies())
def test_fuzz_never_5xx(client: httpx.Client, completion: dict, chat: dict) -> None:
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        r = client.post(path, json=resolve_model(body, "fake-model"))
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_server_healthy_after_fuzz(client: httpx.Client, fake_server: LiveServer) -> None:
    assert wait_for(lambda: fake_server.engine.get_stats().num_running == 0, 5)
    assert client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200
    time.sleep(0)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": "hi", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "documents": []}, "documents"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
])
def test_an_unknown_parameter_is_400_naming_it(client: httpx.Client, path: str, body: dict, field: str) -> None:
    """Nothing a client sends is silently ignored: a field loom does not implement is refused by name."""
    r = client.post(path, json=body)
    assert_error(r, 400, field)
    assert "unknown parameter" in r.json()["error"]["message"] or field == "tool_choice"


def test_harmless_openai_fields_are_accepted(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": False, "metadata": {"a": "b"},
        "service_tier": "auto", "user": "u1", "parallel_tool_calls": False, "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_model_retrieve_version_and_tokenizer_info(client: httpx.Client, fake_server: LiveServer) -> None:
    from openai import NotFoundError, OpenAI

    oai = OpenAI(base_url=fake_server.v1, api_key="x", max_retries=0)
    name = oai.models.list().data[0].id
    assert oai.models.retrieve(name).id == name
    with pytest.raises(NotFoundError):
        oai.models.retrieve("no-such-model")
    import loom

    assert client.get("/version").json() == {"version": loom.__version__} and loom.__version__ != "0+unknown"
    info = client.get("/tokenizer_info").json()
    assert info["vocab_size"] == fake_server.engine.vocab_size and "tokenizer_class" in info


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"\\ud800": 1}, "max_tokens": 2}', "logit_bias"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud83d"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 2}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    # in a key: a top-level one is an unknown parameter, named as the client wrote it (escaped)
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "\\ud800x": 1}', "\\ud800x"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}', "\\udfff"),
    ("/tokenize", '{"prompt": "hi", "\\udbff": 1}', "\\udbff"),
    ("/detokenize", '{"tokens": [1], "\\ud800": 1}', "\\ud800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "\\ud800": 1}], "max_tokens": 2}',
     "messages"),
    ("/v1/completions", '{"prompt": "hi", "stream_options": {"\\ud800": true}, "max_tokens": 2}', "stream_options"),
])
def test_lone_surrogates_are_400_naming_the_field_and_the_connection_stays(client: httpx.Client, path: str,
                                                                           raw: str, param: str) -> None:
    """JSON escapes can carry lone UTF-16 surrogates, which no tokenizer encodes (the real one raised deep in
    the handler: a 500 that dropped the connection). Refused at the edge, on the same keep-alive connection."""
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param)
    assert "surrogate" in r.json()["error"]["message"]
    ok = client.post("/v1/completions", content='{"prompt": "ok \\ud83d\\ude00", "max_tokens": 2}',
                     headers={"content-type": "application/json"})  # a valid surrogate pair is fine
    assert ok.status_code == 200


def test_the_real_tokenizer_cannot_encode_a_lone_surrogate() -> None:
    """Why the edge check exists (the failure it prevents)."""
    from loom.model.loader import load_tokenizer

    with pytest.raises(Exception):  # noqa: B017 - the tokenizers library raises its own error types
        load_tokenizer(None).encode("a\ud800b")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (5 << 20)}], "max_tokens": 1}),
    ("/tokenize", {"prompt": "x" * (5 << 20)}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}),
    ("/v1/completions", {"prompt": "x" * (5 << 20), "max_tokens": 1}),
])
def test_a_probe_answers_while_a_5mb_request_is_templated_and_tokenized(path: str, body: dict) -> None:
    """CPU work of one request (chat template, tokenizer, rendering) runs off the event loop: a liveness probe
    answers at once while a 5 MB request takes a second of (emulated) tokenizer time and is then refused."""
    import threading

    front, _ = make_fake_front(step_delay_s=0.001, large_text_delay_s=1.5)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=30) as probe:
        probe.get("/health")  # connection open
        result: dict[str, Any] = {}

        def big() -> None:
            with httpx.Client(base_url=live.base_url, timeout=60) as c:
                result["status"] = c.post(path, json=body).status_code

        thread = threading.Thread(target=big)
        started = time.monotonic()
        thread.start()
        latencies = []
        while thread.is_alive() and time.monotonic() - started < 10:
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
        thread.join()
        assert time.monotonic() - started >= 1.5  # the emulated tokenizer time did pass
        assert result["status"] in (200, 400), result  # 400: longer than max_model_len
        assert len(latencies) >= 5 and max(latencies) < 0.5, latencies  # on the event loop: >= 1.5 s


def test_response_format_text_with_extra_keys_is_no_constraint(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "response_format": {"type": "text", "strict": False}})
    assert r.status_code == 200, r.text


def test_a_long_token_id_prompt_is_not_scanned_as_text(client: httpx.Client) -> None:
    """The Unicode check skips lists of token ids (a 10^6-id prompt is refused for its length, not rescanned)."""
    r = client.post("/v1/completions", json={"prompt": [5] * 1_000_000, "max_tokens": 1})
    assert_error(r, 400, "prompt")


def test_chat_template_options_reach_the_template(client: httpx.Client) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    plain = client.post("/tokenize", json=base).json()["tokens"]
    cont = client.post("/tokenize", json={**base, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    closed = client.post("/tokenize", json={**base, "add_generation_prompt": False}).json()["tokens"]
    assert cont == closed[:-1] and plain[: len(closed)] == closed and len(plain) > len(closed)
    r = client.post("/v1/chat/completions", json={**base, "max_tokens": 2, "continue_final_message": True})
    assert_error(r, 400, "continue_final_message")  # add_generation_prompt is true by default
    r = client.post("/v1/chat/completions", json={**base, "max_tokens": 2, "add_generation_prompt": False,
                                                  "continue_final_message": True,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 252}, "max_tokens"),  # 5 + 252 > 256
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 247}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 250},
     "max_completion_tokens"),
])
def test_max_tokens_beyond_the_room_left_is_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    """vLLM's rule: more tokens than max_model_len leaves after the prompt is a 400 (it was silently clamped)."""
    r = client.post(path, json=body)
    assert_error(r, 400, param)
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    fits = {**body, param: 1}
    assert client.post(path, json=fits).status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"prompt": "x" * 5000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 5000}]}),
    ("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1}),
])
def test_a_text_beyond_the_character_bound_is_refused_untokenized(path: str, body: dict) -> None:
    """Every route that tokenizes text applies the engine's character bound first (found by a fresh-user
    trial: /tokenize with a prompt tokenized 5 MB in 3.7 s and answered 200)."""
    front, fake = make_fake_front(prompt_char_limit=1000, large_text_delay_s=30.0)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=10) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex", "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "response_format", "min_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format", 'needs "json_schema"'),
])
def test_structured_output_conflicts_name_the_field(client: httpx.Client, body: dict, param: str,
                                                    message: str) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  **body})
    assert_error(r, 400, param)
    assert message in r.json()["error"]["message"]


def test_suffix_is_fill_in_the_middle_with_the_models_fim_tokens() -> None:
    """suffix: the engine gets <|fim_prefix|>prompt<|fim_suffix|>suffix<|fim_middle|> (prefix-suffix-middle);
    a model without FIM tokens, a list prompt, are 400s naming suffix."""
    front, fake = make_fake_front(step_delay_s=0.001, fim=True)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": "def add(a, b):\n", "suffix": "\n    return c\n",
                                            "max_tokens": 2, "echo": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("def add(a, b):\n")  # echo shows the prompt itself
        prompt = fake.tokenizer.encode("<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n<|fim_middle|>")
        assert prompt in fake.added_prompts
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "suffix": "x", "max_tokens": 2})
        assert_error(r, 400, "suffix")


def test_fim_tokens_of_a_real_fast_tokenizer() -> None:
    """fim_tokens reads a Hugging Face tokenizer's vocabulary, and the FIM names in the prompt text encode as
    the single special tokens (added tokens are matched in text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loom.server.serving_completion import fim_tokens

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    assert fim_tokens(tok) is None
    tok.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]})
    names = fim_tokens(tok)
    assert names == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    ids = tok.encode(f"{names[0]}a{names[1]}b{names[2]}", add_special_tokens=False)
    assert ids == [tok.convert_tokens_to_ids(names[0]), 1, tok.convert_tokens_to_ids(names[1]), 2,
                   tok.convert_tokens_to_ids(names[2])]


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
     "tool_calls belong to an assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], "needs the tool_call_id"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "x"}],
     "answers no earlier tool call"),
    ([{"role": "user", "content": "hi", "tool_call_id": "x"}], "tool_call_id belongs to a tool message"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}},
                                                          {"id": "c", "function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "content": "42", "tool_call_id": "c"}], "is used by an earlier call too"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}],
     "arguments are not JSON"),
    # valid JSON strings that decode to what is not: Python's json reads NaN, and \\ud800 to a lone surrogate
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                  "arguments": '{"a": NaN}'}}]}],
     "arguments are not JSON: NaN"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": '{"\\ud800": 1}'}}]}], "arguments contain a lone UTF-16 surrogate"),
])
def test_a_malformed_tool_history_is_400_naming_messages(client: httpx.Client, messages: list, match: str) -> None:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert_error(r, 400, "messages")
    assert match in r.json()["error"]["message"]


def test_bad_tool_definitions_are_400_naming_tools(client: httpx.Client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "tools": [tool, tool]})
    assert_error(r, 400, "tools")


def test_streamed_prompt_logprobs_come_whole_in_the_first_chunk() -> None:
    """prompt_logprobs with stream=true (vLLM refuses them): completions put them in each choice's first chunk,
    chat top-level in the stream's first chunk, as the non-streamed bodies carry them; with a chunked prefill
    (3 prompt positions a step) that chunk waits for all of them, and so does echo's prompt in `logprobs`."""
    front, _ = make_fake_front(step_delay_s=0.002, prompt_chunk=3)
    with serve(front) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        prompt = "the quick brown fox jumps"
        body = {"prompt": prompt, "max_tokens": 4, "n": 2, "temperature": 0, "prompt_logprobs": 2}
        full = client.post("/v1/completions", json=body).json()
        expected = full["choices"][0]["prompt_logprobs"]
        assert expected[0] is None and len(expected) == full["usage"]["prompt_tokens"] > 6
        assert all(entry is not None for entry in expected[1:])
        events = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
        firsts: dict[int, dict] = {}
        for ev in events:
            for ch in ev["choices"]:
                if ch["index"] not in firsts:
                    firsts[ch["index"]] = ch
                else:
                    assert "prompt_logprobs" not in ch
        assert sorted(firsts) == [0, 1] and all(ch["prompt_logprobs"] == expected for ch in firsts.values())

        echo = sse_events(client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}).text)
        first = echo[0]["choices"][0]["logprobs"]
        assert len(first["tokens"]) >= full["usage"]["prompt_tokens"]
        assert first["token_logprobs"][0] is None and None not in first["token_logprobs"][1:]

        chat = {"messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 0, "prompt_logprobs": 1}
        full = client.post("/v1/chat/completions", json=chat).json()
        events = sse_events(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
        assert events[0]["prompt_logprobs"] == full["prompt_logprobs"] and full["prompt_logprobs"][0] is None
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert not any("prompt_logprobs" in ev for ev in events[1:])


@pytest.mark.parametrize("n", [0, 1, 32767, 32768, 32769, 100_000])
def test_int_list_json_is_the_compact_json_of_the_list(n: int) -> None:
    """/tokenize's chunked encoding writes the bytes one json.dumps of the whole list writes (compact)."""
    import json

    from loom.server.api_server import int_list_json

    values = [(i * 7919) % 100_003 - 50_000 for i in range(n)]
    assert f"[{int_list_json(values)}]" == json.dumps(values, separators=(",", ":"))


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 1}, "messages",
     "messages.0: a tool message needs the tool_call_id of the call it answers"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "use_beam_search": True, "n": 2, "early_stopping": 3},
     "early_stopping", 'early_stopping: early_stopping must be true, false or "never", got 3'),
])
def test_a_validators_message_reaches_the_client_as_written(client: httpx.Client, path: str, body: dict,
                                                            param: str, message: str) -> None:
    """A field validator's ValueError is the message, named by its field, without pydantic's 'Value error, '
    prefix (which named an exception class the client never sees)."""
    r = client.post(path, json=body)
    assert_error(r, 400, param)
    assert r.json()["error"]["message"] == message


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_stream_options_without_stream_is_400(client: httpx.Client, path: str, body: dict) -> None:
    """It was accepted and ignored; OpenAI and vLLM refuse it."""
    assert_error(client.post(path, json={**body, "stream_options": {"include_usage": True}}), 400, "stream_options")
    assert_error(client.post(path, json={**body, "stream": False, "stream_options": {}}), 400, "stream_options")
    assert client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}}).status_code == 200
