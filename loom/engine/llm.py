"""Offline API: LLM.generate, LLM.chat and LLM.stream."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from loom.config import EngineArgs
from loom.engine.beam_search import BeamSearchParams
from loom.engine.llm_engine import LLMEngine
from loom.kernels.openmp import release_thread_pool
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Run a model offline.

    >>> llm = LLM()                      # the bundled SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); list in, list out, order kept.

        Raises:
            ValueError: a prompt or parameter is invalid (nothing is left queued).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                ids.append(self._add(prompt, params))
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search for every prompt (transformers' algorithm; loom/engine/beam_search.py): one finished
        RequestOutput per prompt whose outputs are the params.n best sequences, best score first, each with
        its cumulative_logprob. Beams share their prefix's KV blocks.

        Raises:
            ValueError: a prompt or parameter is invalid (nothing is left queued).
        """
        params = params or BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        ids: list[str] = []
        try:
            for prompt in _as_prompt_list(prompts):
                ids.append(self._add(prompt, params))
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template.

        Each message is {"role": one of CHAT_ROLES, "content": str or a list of text parts ({"type": "text",
        "text": str}, joined)}, as the server takes them: only an assistant message may leave its content out (or
        None; it is then "").
        The template options are LLMEngine.apply_chat_template's (continue_final_message: the model continues
        the last, assistant, message; chat_template_kwargs: extra template variables).

        Raises:
            ValueError: an empty conversation, or a message without a known role, with non-text content or, unless
                it is an assistant's, without content; or template options that contradict each other.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("messages must not be empty")
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template_kwargs": chat_template_kwargs}
        prompts = [self.engine.apply_chat_template(_checked_conversation(conv), **options) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per engine step with news (delta_text / delta_token_ids), the last finished.

        Closing the iterator early aborts the request.
        """
        request_id = self._add(prompt, sampling_params or SamplingParams())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request([request_id])
            release_thread_pool(rescan=False)  # as _run does: the next call may come from another thread

    def _add(self, prompt: Prompt, params: SamplingParams | BeamSearchParams) -> str:
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 8)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(sorted(pending))
            raise
        finally:
            bar.close()
            # the next call may come from another thread (a warm-up here, then a web app's worker thread): a pool
            # left on this one would make every barrier of that thread's steps sleep (loom/kernels/openmp.py); the
            # engine's construction scanned the loaded runtimes
            release_thread_pool(rescan=False)
        return [results[i] for i in ids]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles the server's ChatMessage takes


def join_text_parts(parts: Sequence[object]) -> str | None:
    """OpenAI's content parts as one string: the texts of {"type": "text", "text": str} parts, joined; None when
    any part is something else (an image, say), which loom does not take. Used by LLM.chat and the server."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return None
    return "".join(p["text"] for p in parts)  # type: ignore[index]


def _checked_conversation(conversation: object) -> list[dict]:
    """A conversation as plain {"role", "content"} dicts (an assistant's content None -> ""), or ValueError naming
    the message."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        if isinstance(content, (list, tuple)):  # OpenAI's content parts, joined as the server joins them
            content = join_text_parts(content)
            if content is None:
                raise ValueError(f"messages[{i}].content: only text content parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got "
                             f"{type(content).__name__}")
        # the server's rule (OpenAI's): only an assistant turn may omit its content
        if content is None and role != "assistant":
            raise ValueError(f"messages[{i}].content is required for a {role!r} message")
        checked.append({**message, "content": content or ""})
    return checked


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):  # a dict of fields would be read as its keys
        raise ValueError(f"sampling_params must be a SamplingParams or a list of one per prompt, got "
                         f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts")
    return params
