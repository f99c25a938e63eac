"""A small, fast, deterministic stand-in for LLMEngine with the same interface (server tests).

Tokenizer: one token per UTF-8 byte (id = byte + 3) plus three special tokens. Generation: greedy
picks a lowercase letter from (last token, position); seeded sampling uses the request's seed.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from loom.engine.async_engine import QueueFullError
from loom.engine.model_identity import ModelIdentity
from loom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loom.sampling_params import SamplingParams

EOS, IM_START, IM_END = 0, 1, 2
SPECIAL = {EOS: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


class FakeTokenizer:
    eos_token_id = EOS

    def __init__(self, vocab_size: int, large_text_delay_s: float = 0.0, fim: bool = False) -> None:
        self.vocab_size = vocab_size  # ids >= 259 decode to nothing
        self.large_text_delay_s = large_text_delay_s  # emulated CPU time to encode a text of 1 MB or more
        self.fim = fim  # claim Qwen's fill-in-the-middle tokens (get_vocab)

    def get_vocab(self) -> dict[str, int]:
        names = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>") if self.fim else ()
        return {name: 260 + i for i, name in enumerate(names)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.large_text_delay_s and len(text) >= 1 << 20:
            time.sleep(self.large_text_delay_s)  # wherever this runs, that thread is busy meanwhile
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i in SPECIAL:
                if not skip_special_tokens:
                    out += SPECIAL[i].encode()
            elif 3 <= i < 259:
                out.append(i - 3)
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i], skip_special_tokens=False) for i in ids]


@dataclass(slots=True)
class FakeStats:
    num_running: int  # requests
    num_waiting: int  # requests
    kv_cache_usage: float  # 0..1
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative
    num_blocks_offloaded: int = 0  # cumulative device -> host tier block copies
    num_blocks_restored: int = 0  # cumulative host tier -> device block copies
    num_blocks_recomputed: int = 0  # cumulative computed blocks dropped by preemption


@dataclass(slots=True)
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    metrics: RequestMetrics
    outs: list[CompletionOutput] = field(default_factory=list)
    rngs: list[random.Random] = field(default_factory=list)
    running: bool = False
    sent_prompt_logprobs: bool = False
    prompt_done: int = 0  # prompt positions prefilled (with prompt_chunk)


class FakeEngine:
    """Same surface as LLMEngine; `step_delay_s` emulates compute, `fail_next_step` injects a crash."""

    def __init__(self, max_model_len: int = 256, vocab_size: int = 300, num_kv_blocks: int = 64,
                 block_size: int = 16, max_num_seqs: int = 8, max_waiting_requests: int | None = None,
                 step_delay_s: float = 0.0, large_text_delay_s: float = 0.0,
                 prompt_char_limit: int | None = None, fim: bool = False, prompt_chunk: int | None = None) -> None:
        # chunked prefill's stand-in: this many prompt positions a step, their prompt logprobs delivered as they
        # come (cumulative, as the output processor gives them) and no token before the prompt is done
        self.prompt_chunk = prompt_chunk
        self.prompt_char_limit = prompt_char_limit  # LLMEngine.max_prompt_chars's stand-in; None: no bound
        self.tokenizer = FakeTokenizer(vocab_size, large_text_delay_s, fim)
        self.model_name = "fake-model"
        self.model_identity = ModelIdentity("fake-model", "0" * 64, "none", "float32", "float32", "0" * 64)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv_bytes_per_token = 1024
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.step_delay_s = step_delay_s
        self.fail_next_step = False
        self.reqs: dict[str, _Req] = {}
        self.added_prompts: list[list[int]] = []  # every accepted request's prompt ids, in order
        self.num_steps = 0
        self._queries = 0
        self._seen_prefixes: set[tuple[int, ...]] = set()
        self._hits = 0
        self.offload_counters = [0, 0, 0]  # tests set these: num_blocks_offloaded, _restored, _recomputed

    # -- interface --
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_chars(prompt)
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        if request_id in self.reqs:
            raise ValueError(f"request_id {request_id!r} already exists")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt contains token id {t} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, max_model_len is {self.max_model_len}")
        waiting = sum(1 for r in self.reqs.values() if not r.running)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise QueueFullError("the waiting queue is full")
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        now = time.monotonic()
        r = _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, max_tokens,
                 RequestMetrics(arrival_time=now if arrival_time is None else arrival_time))
        r.outs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=0.0,
                                   logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        base = params.seed if params.seed is not None else 1234
        r.rngs = [random.Random(base * 1000 + i) for i in range(params.n)]
        key = (cache_salt or "",) + tuple(ids[: len(ids) // self.block_size * self.block_size])
        self._queries += len(ids)
        if key in self._seen_prefixes:
            self._hits += len(key) - 1
        self._seen_prefixes.add(key)  # type: ignore[arg-type]
        self.reqs[request_id] = r
        self.added_prompts.append(list(ids))

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.reqs.pop(rid, None)

    def shutdown(self) -> None:
        self.shut_down = True  # LLMEngine.shutdown stops an executor's workers; the fake has none

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def check_prompt_chars(self, text: str, name: str = "prompt") -> None:
        if self.prompt_char_limit is not None and len(text) > self.prompt_char_limit:
            raise ValueError(f"{name} of {len(text)} characters cannot fit max_model_len={self.max_model_len} tokens")

    def check_structured_output(self, params: SamplingParams) -> None:
        if params.structured_output is not None:  # the fake decodes no grammar: shape checks only
            params.structured_output.verify()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            tools: list | None = None) -> list[int]:
        self.check_prompt_chars("".join(str(m.get("content") or "") for m in messages), "messages")
        ids: list[int] = []
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unsupported role {m.get('role')!r}")
            ids += [IM_START] + self.tokenizer.encode(f"{m['role']}\n{m.get('content') or ''}")
            if not (continue_final_message and i == len(messages) - 1):
                ids.append(IM_END)
        return ids + ([IM_START] + self.tokenizer.encode("assistant\n") if add_generation_prompt else [])

    def used_blocks(self) -> int:
        return sum(len(r.outs) * math.ceil((len(r.prompt_token_ids) + max((len(o.token_ids) for o in r.outs), default=0))
                                            / self.block_size) for r in self.reqs.values() if r.running)

    def get_stats(self) -> FakeStats:
        used = self.used_blocks()
        running = sum(1 for r in self.reqs.values() if r.running)
        return FakeStats(running, len(self.reqs) - running, used / self.num_kv_blocks,
                         self.num_kv_blocks - used, self.num_kv_blocks, self._queries, self._hits, 0,
                         *self.offload_counters)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        now = time.monotonic()
        running = [r for r in self.reqs.values() if r.running]
        for r in self.reqs.values():
            if not r.running and len(running) < self.max_num_seqs:
                r.running = True
                r.metrics.first_scheduled_time = now
                running.append(r)
        results = []
        for r in running:
            results.append(self._advance(r, now))
            if results[-1].finished:
                del self.reqs[r.request_id]
        return results

    # -- generation --
    def _advance(self, r: _Req, now: float) -> RequestOutput:
        if self.prompt_chunk is not None:
            r.prompt_done = min(len(r.prompt_token_ids), r.prompt_done + self.prompt_chunk)
            if r.prompt_done < len(r.prompt_token_ids):  # still prefilling
                for o in r.outs:
                    o.delta_text, o.delta_token_ids = "", []
                return self._output(r, self._prompt_logprobs(r, r.prompt_done), False)
        for o, rng in zip(r.outs, r.rngs):
            o.delta_text, o.delta_token_ids = "", []
            if o.finish_reason is not None:
                continue
            if len(o.token_ids) >= r.max_tokens:
                o.finish_reason = "length"
                continue
            last = (o.token_ids or r.prompt_token_ids)[-1]
            pos = len(r.prompt_token_ids) + len(o.token_ids)
            if r.params.temperature == 0.0:
                tok = 3 + ord("a") + (last + pos) % 26
            else:
                tok = 3 + ord("a") + rng.randrange(26)
            o.token_ids.append(tok)
            o.delta_token_ids = [tok]
            piece = self.tokenizer.decode([tok])
            o.text += piece
            o.delta_text = piece
            o.cumulative_logprob = (o.cumulative_logprob or 0.0) - 0.5
            if o.logprobs is not None:
                o.logprobs.append(self._position_logprobs(tok, r.params.logprobs or 0))
            for s in r.params.stop:
                at = o.text.find(s)
                if at >= 0:
                    keep = at + len(s) if r.params.include_stop_str_in_output else at
                    cut = len(o.text) - keep
                    o.text = o.text[:keep]
                    o.delta_text = o.delta_text[: max(0, len(o.delta_text) - cut)]
                    o.finish_reason, o.stop_reason = "stop", s
                    break
            if o.finish_reason is None and len(o.token_ids) >= r.max_tokens:
                o.finish_reason = "length"
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = now
        r.metrics.last_token_time = now
        finished = all(o.finish_reason is not None for o in r.outs)
        if finished:
            r.metrics.finished_time = now
        prompt_logprobs = None
        if r.params.prompt_logprobs is not None and (self.prompt_chunk is not None or not r.sent_prompt_logprobs):
            r.sent_prompt_logprobs = True
            prompt_logprobs = self._prompt_logprobs(r, len(r.prompt_token_ids))
        return self._output(r, prompt_logprobs, finished)

    def _prompt_logprobs(self, r: _Req, upto: int) -> list[dict[int, Logprob] | None] | None:
        """[None] + an entry for each prompt position 1 .. upto - 1; None when the request asked for none."""
        if r.params.prompt_logprobs is None:
            return None
        return [None] + [self._position_logprobs(t, r.params.prompt_logprobs) for t in r.prompt_token_ids[1:upto]]

    def _output(self, r: _Req, prompt_logprobs: list | None, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=[CompletionOutput(o.index, o.text, list(o.token_ids), o.delta_text, list(o.delta_token_ids),
                                      o.cumulative_logprob, list(o.logprobs) if o.logprobs is not None else None,
                                      o.finish_reason, o.stop_reason) for o in r.outs],
            finished=finished, metrics=RequestMetrics(**{k: getattr(r.metrics, k) for k in RequestMetrics.__slots__}))

    def _position_logprobs(self, tok: int, top: int) -> dict[int, Logprob]:
        """The chosen token (rank 1, -0.5) plus others up to rank `top`; the last of those is -inf (clamping)."""
        d = {tok: Logprob(-0.5, 1, self.tokenizer.decode([tok]))}
        for k in range(top - 1):
            other = 3 + ord("A") + k
            d.setdefault(other, Logprob(-math.inf if k == top - 2 else -2.0 - k, k + 2, self.tokenizer.decode([other])))
        return d
