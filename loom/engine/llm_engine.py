"""The engine: add_request / abort_request / step. `step()` is schedule -> execute -> update, nothing else."""

from __future__ import annotations

import functools

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.attention.kv_quant import describe_kv_format
from loom.config import CacheConfig, EngineArgs
from loom.core.scheduler import Scheduler
from loom.core.sched_output import EngineCoreOutput, SchedulerOutput
from loom.engine.beam_search import BeamSearchManager, BeamSearchParams
from loom.engine.model_identity import ModelIdentity, tokenizer_sha256, weights_sha256
from loom.engine.output_processor import OutputProcessor
from loom.outputs import RequestOutput
from loom.sample.structured import StructuredOutputManager
from loom.request import Request, RequestStatus
from loom.sample.penalties import check_params_against_vocab
from loom.sampling_params import SamplingParams
from loom.spec.proposer import ProposerContext, make_proposer
from loom.executor import Executor, ExecutorDiedError, make_executor
from loom.executor.worker import threads_per_rank
from loom.kernels.openmp import release_thread_pool
from loom.kv_transfer.base import PARAM as KV_TRANSFER_PARAM, KVTransferRequest, RemoteKV, parse_kv_transfer_request

logger = logging.getLogger(__name__)

# arguments of transformers' apply_chat_template that chat_template_kwargs may not override
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(slots=True)
class EngineStats:
    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests queued (new or preempted)
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative prompt tokens served from it
    num_preemptions: int  # cumulative
    num_fair_share_preemptions: int = 0  # cumulative; of them, copies preempted to seat another user's request
    num_blocks_offloaded: int = 0  # cumulative device -> host tier block copies
    num_blocks_restored: int = 0  # cumulative host tier -> device block copies
    num_blocks_recomputed: int = 0  # cumulative computed blocks dropped by (non-swap) preemption
    spec_num_drafts: int = 0  # cumulative verify passes that carried drafts (speculative decoding)
    spec_num_draft_tokens: int = 0  # cumulative draft tokens proposed
    spec_num_accepted_tokens: int = 0  # cumulative draft tokens kept
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # cumulative kept drafts at position 0, 1, ...
    spec_num_branches: int = 0  # cumulative candidate branches verified (tree candidates; one per chain)
    spec_num_branch_wins: int = 0  # cumulative verify passes kept from a branch other than the first
    # mixture of experts: cumulative (token, expert) routings per expert, summed over the MoE layers rank 0 runs
    # (all of them, or its pipeline stage's); () for a dense model
    moe_expert_tokens: tuple[int, ...] = ()
    # prefill/decode disaggregation (loom/kv_transfer): transfers pinned now (producer), and cumulative counts
    kv_transfer_pinned: int = 0  # finished requests whose prompt blocks wait for a decode replica
    kv_transfer_expired: int = 0  # pinned transfers freed unread by the timeout
    kv_transfer_pulls: int = 0  # successful pulls (consumer)
    kv_transfer_pull_failures: int = 0  # pulls that fell back to computing the prompt locally
    kv_transfer_blocks_loaded: int = 0  # pulled blocks written instead of computed
    kv_retention_blocks_dropped: int = 0  # cumulative KV blocks KV retention policies dropped (docs/long_context.md)


def _retention_refused(arch: Any, args: EngineArgs) -> str | None:
    """What makes lossy KV retention impossible on this engine (None: nothing): a compacted block table breaks a
    sliding window's position arithmetic, and the other ranks of a model-parallel engine do not get the offsets."""
    if any(arch.layer_sliding_window(i) is not None for i in range(arch.num_layers)):
        return "a model with sliding-window layers"
    if args.parallel_config().world_size > 1:
        return args.parallel_config().describe_sizes()
    return None


def attention_setting(cache_config: CacheConfig) -> str:
    """The engine's lossy attention settings as one string for its model identity ("exact" when none): two
    engines answer alike only when their KV retention and block-sparse decode settings agree too."""
    parts = []
    r = cache_config.kv_retention
    if r.lossy:
        parts.append(f"kv_retention={r.policy}:budget={r.budget:g}:sinks={r.sink_tokens}:window={r.window}")
    if cache_config.sparse_attention != "none":
        parts.append(f"sparse_attention={cache_config.sparse_attention}:topk={cache_config.sparse_attention_topk}"
                     f":sinks={cache_config.sparse_attention_sink_blocks}"
                     f":recent={cache_config.sparse_attention_recent_blocks}")
    return ";".join(parts) or "exact"


class LLMEngine:
    """Single-threaded engine. Not thread-safe: one owner calls every method (see AsyncLLMEngine)."""

    def __init__(self, args: EngineArgs) -> None:
        world = args.parallel_config().world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine (torchrun says)
        _set_num_threads(args.num_threads if world == 1 else threads_per_rank(args.num_threads, local))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model_config = args.model_config()
        cache_config = args.cache_config()
        self.attention_setting = attention_setting(cache_config)  # part of the model identity (result cache key)
        if args.kv_retention == "full":
            defaults = EngineArgs()
            unused = [f"--{n.replace('_', '-')}" for n in ("kv_retention_budget", "kv_retention_sink_tokens",
                                                             "kv_retention_window")
                      if getattr(args, n) != getattr(defaults, n)]
            if unused:
                logger.warning("%s: no effect without a lossy --kv-retention (the engine's default for requests that "
                               "name a policy themselves)", ", ".join(unused))
        started = time.perf_counter()
        # the load takes seconds (tens on a first run, which also builds the CPU kernels): say it has begun
        logger.info("loading %s ...", model_config.model or "the bundled SmolLM2-135M-Instruct")
        self.executor: Executor = make_executor(model_config, cache_config, args.parallel_config(), device,
                                                args.num_threads)
        self.runner = self.executor.driver  # rank 0's runner: shapes, tokenizer, KV cache layout
        arch = self.runner.arch
        self.tokenizer = self.runner.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"model {self.runner.model_path!r} has no tokenizer (tokenizer.json or tokenizer.model)")
        self.eos_token_ids = self.runner.eos_token_ids
        self.vocab_size = arch.vocab_size
        self.max_model_len = _resolve_max_model_len(args.max_model_len, arch.max_position_embeddings)
        self.model_name = Path(self.runner.model_path).name
        self.block_size = cache_config.block_size
        self.num_kv_blocks = self.runner.num_blocks
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        spec = args.speculative_config()
        # grammar matchers of structured-output requests (built on first use: llguidance wraps the tokenizer);
        # the scheduler checks such requests' drafts against them
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(
            args.scheduler_config(self.max_model_len), cache_config, self.num_kv_blocks,
            num_host_blocks=self.runner.num_host_blocks,
            sliding_window=self.runner.kv_groups[0].sliding_window if len(self.runner.kv_groups) == 1 else None,
            kv_group_windows=[g.sliding_window for g in self.runner.kv_groups],
            proposer=make_proposer(spec, ProposerContext(
                dtype=model_config.dtype, quantization=model_config.quantization, seed=model_config.seed,
                block_size=cache_config.block_size, kv_cache_memory_bytes=cache_config.kv_cache_memory_bytes,
                device=device, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                tokenizer=self.tokenizer)) if spec is not None else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            spec_disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
            spec_tree_width=spec.tree_width if spec is not None else 1,
            draft_grammar=self.structured,
            kv_transfer_timeout_s=args.kv_transfer_timeout_s,
            kv_retention_refused=_retention_refused(arch, args),
        )
        self.kv_transfer = self._make_kv_transfer(args)
        if spec is not None:
            options = {
                "ngram": f"prompt lookup n = {spec.prompt_lookup_min}..{spec.prompt_lookup_max}",
                "suffix": f"tree depth {spec.suffix_max_tree_depth}, {spec.suffix_max_cached_requests} cached "
                          f"outputs, min token prob {spec.suffix_min_token_prob}",
                "draft_model": f"draft {spec.model}",
            }[spec.method]
            if spec.tree_width > 1:
                options += f", tree candidates: up to {spec.tree_width} branches per greedy request"
            logger.info("speculative decoding: %s, up to %d draft tokens per request and step (%s), %s",
                        spec.method, spec.num_speculative_tokens, options,
                        "at every batch size" if spec.disable_by_batch_size is None
                        else f"off while >= {spec.disable_by_batch_size} requests run")
        self._moe_blocks = self.runner.moe_blocks
        self.output_processor = OutputProcessor(self.tokenizer)
        self.runner.structured = self.structured
        self._children: dict[str, list[str]] = {}  # parent request_id -> engine request ids
        self.beam_search = BeamSearchManager(self.scheduler, self.tokenizer, self.eos_token_ids)
        groups = self.runner.kv_groups
        # tokens the cache holds for every layer (a hybrid cache's block is a page of one group's layers, and its
        # sliding groups need only their window, so long requests fit more than this)
        self.kv_capacity_tokens = self.num_kv_blocks * self.block_size * len(groups[0].layers) // arch.num_layers
        per_block = "" if len(groups) == 1 else f" x {len(groups[0].layers)} of {arch.num_layers} layers"
        hybrid = "" if len(groups) == 1 else (
            f" (hybrid: {len(groups)} layer groups, {sum(g.sliding_window is not None for g in groups)} of them "
            f"sliding over {max(g.sliding_window or 0 for g in groups)} tokens, which hold only that window)")
        logger.info(
            "loaded %s (%s, %s) in %.1f s; KV cache (%s): %d bytes/token, %d blocks of %d tokens%s = %d tokens of "
            "every layer%s; host tier: %d blocks = %d tokens",
            self.model_name, arch.architecture, self.runner.dtype, time.perf_counter() - started,
            _kv_dtype_label(self.runner.kv_cache_dtype), self.kv_bytes_per_token, self.num_kv_blocks,
            self.block_size, per_block, self.kv_capacity_tokens, hybrid,
            self.runner.num_host_blocks, self.runner.num_host_blocks * self.block_size,
        )
        if self.attention_setting != "exact":
            logger.info("long context (docs/long_context.md): %s", self.attention_setting.replace(";", "; "))

        report = getattr(self.runner.model, "weight_report", None)
        if report is not None:
            parts = report()
            logger.info(
                "weights%s (quantization %s): %s; a decode step reads %.1f MB of them",
                "" if args.parallel_config().world_size == args.context_parallel_size else " of rank 0's shard",
                getattr(self.runner.model.quant_config, "name", "none"),
                "; ".join(f"{kind} {fmt} {nbytes / 1e6:.1f} MB" for kind, (fmt, nbytes) in parts.items()),
                sum(n for kind, (_, n) in parts.items() if kind != "embed_tokens") / 1e6,
            )
        # Loading opened parallel regions on this thread, and the thread that steps the engine may be another
        # (AsyncLLMEngine's engine thread, a caller's worker thread): a pool left here would make libgomp count
        # more threads than a small machine's CPUs and sleep at every barrier of a step (loom/kernels/openmp.py).
        # If this thread steps, its first region starts a new pool.
        release_thread_pool()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _make_kv_transfer(self, args: EngineArgs) -> Any:
        """The KV transfer agent of a disaggregated replica (loom/kv_transfer/agent.py), or None.

        Raises:
            ValueError: kv_transfer_role with a model whose KV cache has several groups (Gemma's hybrid cache).
        """
        config = args.kv_transfer_config()
        if config is None:
            return None
        if len(self.runner.kv_groups) > 1:
            raise ValueError("kv_transfer_role: the hybrid sliding-window KV cache (Gemma 2 / 3) cannot be "
                             "transferred yet; switch it off with --no-hybrid-kv-cache")
        from loom.kv_transfer.agent import KVTransferAgent
        from loom.kv_transfer.tensors import kv_layout

        # the model identity's digest (weight bytes, quantization, dtypes, tokenizer): K/V computed by another
        # build of the same file name must never be loaded
        identity = self.model_identity.digest
        layout = kv_layout(self.runner.kv_caches, self.block_size, self.runner.arch.head_dim, identity)
        return KVTransferAgent(config, layout, self.scheduler.pinned_kv, self.runner.kv_caches)

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallel) and the KV transfer server; the engine cannot step
        afterwards. Idempotent."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.executor.shutdown()

    def on_idle(self) -> None:
        """Housekeeping while no request runs (the async front calls it every idle poll): free pinned KV blocks
        that were pulled, released or expired."""
        self.scheduler.release_pinned_kv(time.monotonic())

    def parse_kv_transfer(self, data: Any) -> KVTransferRequest | None:
        """Validate a request's kv_transfer_params against this replica's role.

        Raises:
            ValueError: naming kv_transfer_params: malformed, or a role this replica does not play.
        """
        config = self.kv_transfer.config if self.kv_transfer is not None else None
        # the role first: a replica that plays neither need not judge the fields
        if isinstance(data, KVTransferRequest):
            decode, prefill = data.do_remote_decode, not data.do_remote_decode
        else:
            decode = isinstance(data, dict) and data.get("do_remote_decode") is True
            prefill = isinstance(data, dict) and data.get("do_remote_prefill") is True
        if decode and (config is None or not config.is_producer):
            raise ValueError(f"{KV_TRANSFER_PARAM}: do_remote_decode needs a prefill replica "
                             "(loom serve --kv-transfer-role producer or both)")
        if prefill and (config is None or not config.is_consumer):
            raise ValueError(f"{KV_TRANSFER_PARAM}: do_remote_prefill needs a decode replica "
                             "(loom serve --kv-transfer-role consumer or both)")
        request = data if isinstance(data, KVTransferRequest) else parse_kv_transfer_request(data)
        remote = request.remote if request is not None else None
        if remote is not None and config is not None and not config.allows_peer(remote.remote_host):
            raise ValueError(f"{KV_TRANSFER_PARAM}: remote_host {remote.remote_host!r} is not an allowed prefill "
                             "replica (loom serve --kv-transfer-peers HOST ...)")
        return request

    def pull_remote_kv(self, transfer: KVTransferRequest | None, prompt_token_ids: list[int],
                       params: SamplingParams | BeamSearchParams) -> RemoteKV | None:
        """Pull a decode request's prompt K/V from its prefill replica (any thread; the async front runs it in a
        worker thread). None when there is nothing to pull, the request must compute its prompt anyway
        (prompt_logprobs), or the pull failed (logged and counted: the prompt is then computed here)."""
        if transfer is None or transfer.remote is None or self.kv_transfer is None:
            return None
        if not isinstance(params, SamplingParams) or params.prompt_logprobs is not None:
            self.kv_transfer.connector.release(transfer.remote, self.kv_transfer.config.pull_timeout_s)
            return None
        return self.kv_transfer.pull(transfer.remote, prompt_token_ids)

    # ---- requests -------------------------------------------------------------------------------------------

    @functools.cached_property
    def model_identity(self) -> ModelIdentity:
        """What this engine serves, down to the weight bytes (loom/engine/model_identity.py): hashed on first use
        (a 100 MB file: ~0.3 s, then remembered on disk while the file is unchanged)."""
        return ModelIdentity(
            name=self.model_name, weights_sha256=weights_sha256(self.runner.model_path),
            quantization=str(getattr(self.runner.model.quant_config, "name", "none")),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.runner.kv_cache_dtype).removeprefix("torch."),
            tokenizer_sha256=tokenizer_sha256(self.tokenizer), attention=self.attention_setting)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit max_model_len tokens, whatever it says: max_model_len times
        the longest token's length in characters (a byte-level token's string has one character per byte, and
        a decoded character is at least one byte, so no token covers more characters than that)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return self.max_model_len * max(longest, 1)

    def check_prompt_chars(self, text: str, name: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text that is not valid Unicode (a lone UTF-16 surrogate: what Python
        makes of bytes that are not UTF-8 in argv or stdin, or of a \\ud800 escape; no tokenizer can encode one)
        or too long to fit max_model_len (see max_prompt_chars).

        Raises:
            ValueError: naming `name`.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(text[exc.start])
            raise ValueError(f"{name} is not valid Unicode: a lone surrogate U+{code:04X} at character {exc.start}"
                             + (" (a byte that is not UTF-8: is the terminal's encoding UTF-8?)"
                                if 0xDC80 <= code <= 0xDCFF else "")) from None
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"{name} of {len(text)} characters cannot fit max_model_len={self.max_model_len} "
                             f"tokens (no token of this tokenizer is longer than "
                             f"{self.max_prompt_chars // self.max_model_len} characters)")

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint now (cached), so a bad one fails at the edge.

        Raises:
            ValueError: the constraint is invalid.
        """
        if params.structured_output is None:
            return
        self.structured.compile(params.structured_output)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt; a list of ints is checked against the vocabulary. Raises ValueError (also for a
        text too long to fit max_model_len, refused before it is tokenized)."""
        if isinstance(prompt, str):
            self.check_prompt_chars(prompt)
            return list(self.tokenizer.encode(prompt))  # the tokenizer's own BOS rule, as its model expects
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Args:
            add_generation_prompt: end with the template's assistant header (the reply starts there).
            continue_final_message: leave the last message (an assistant turn) open, so the model continues it
                (transformers' flag); needs add_generation_prompt False.
            chat_template_kwargs: extra variables for the template (e.g. a model's enable_thinking).
            tools: OpenAI tool definitions, for a template that renders them (loom/server/tool_calls.py).

        Raises:
            ValueError: the model has no chat template; the messages' text cannot fit max_model_len (checked before
                templating); both
                add_generation_prompt and continue_final_message; continue_final_message without a last
                assistant message; a chat_template_kwargs key that is one of the template call's own arguments.
        """
        self.check_prompt_chars("".join(str(m.get("content") or "") for m in messages), "messages")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt false")
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final_message needs the last message to be an assistant turn")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: model {self.model_name!r} has no chat template (a base model): send plain "
                             "text instead (/v1/completions, `loom generate --raw`)")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: they are the template call's own")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tools=tools, **extra)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        kv_transfer_params: Any = None,
        remote_kv: RemoteKV | None = None,
    ) -> None:
        """Queue a request (n > 1 becomes n engine requests, merged back into one RequestOutput). With
        BeamSearchParams it is a beam search (loom/engine/beam_search.py): one RequestOutput, when it ends,
        with the n best sequences.

        `prompt_token_ids`: `tokenize(prompt)` of a text prompt, when the caller already ran it (the async
        front tokenizes off the engine thread, so a huge prompt does not stall every other request).

        `kv_transfer_params` (prefill/decode disaggregation, docs/disaggregation.md): {"do_remote_decode": true}
        on a prefill replica computes the prompt and at most one token (max_tokens is capped at 1), keeps the
        prompt's blocks pinned and puts where to pull them in the final RequestOutput's kv_transfer_params;
        {"do_remote_prefill": true, ...those fields} on a decode replica loads the pulled blocks instead of
        computing them (`remote_kv`, pulled by the caller with pull_remote_kv; pulled here when None).

        Raises:
            ValueError: the request can never run (names the parameter); nothing is kept.
            QueueFullError: the waiting queue is full.
        """
        if request_id in self._children or request_id in self.beam_search:
            raise ValueError(f"request_id {request_id!r} is already in use")
        transfer = self.parse_kv_transfer(kv_transfer_params)
        if transfer is not None and (isinstance(params, BeamSearchParams) or params.n != 1):
            raise ValueError(f"{KV_TRANSFER_PARAM} needs a single sample (n = 1, no beam search)")
        if isinstance(params, BeamSearchParams):
            self._add_beam_search(request_id, prompt, params, arrival_time, cache_salt, prompt_token_ids)
            return
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: fields may have been changed since construction
        check_params_against_vocab(params, self.vocab_size)  # here, not mid-batch where it fails every request
        if params.structured_output is not None:
            self.check_structured_output(params)
        prompt_text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None or prompt_text is None:
            prompt_token_ids = self.tokenize(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        room = self.max_model_len - len(prompt_token_ids)
        if room < 0 or (room == 0 and params.max_tokens != 0):
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        kv_transfer_id = None
        if transfer is not None and transfer.do_remote_decode:
            max_tokens = min(max_tokens, 1)  # the prefill's part: the decode replica generates the output
            kv_transfer_id = f"{request_id}-{uuid.uuid4().hex[:16]}"
        elif transfer is not None and remote_kv is None:
            remote_kv = self.pull_remote_kv(transfer, prompt_token_ids, params)
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        added: list[str] = []
        try:
            for index, child_id in enumerate(child_ids):
                child_params = params.clone()
                if index > 0:
                    # one prompt, so its logprobs once: copy 0 computes them (the output processor reads
                    # copy 0's); the others may then use the prefix cache, which prompt_logprobs skips
                    child_params.prompt_logprobs = None
                if params.seed is not None:
                    child_params.seed = params.seed + index  # independent samples, still reproducible
                self.scheduler.add_request(
                    Request(
                        request_id=child_id,
                        prompt_token_ids=prompt_token_ids,
                        sampling_params=child_params,
                        eos_token_ids=self.eos_token_ids,
                        arrival_time=arrival_time,
                        max_tokens=max_tokens,
                        cache_salt=cache_salt,
                        group_id=request_id,
                        kv_transfer_id=kv_transfer_id,
                        remote_kv=remote_kv,
                    )
                )
                added.append(child_id)
        except BaseException:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        for index, child_id in enumerate(child_ids):
            self.output_processor.add_request(
                request_id=child_id, parent_id=request_id, index=index, n=params.n, prompt=prompt_text,
                prompt_token_ids=prompt_token_ids, params=params, arrival_time=arrival_time,
            )
        self._children[request_id] = child_ids

    def _add_beam_search(self, request_id: str, prompt: str | list[int], params: BeamSearchParams,
                         arrival_time: float | None, cache_salt: str | None,
                         prompt_token_ids: list[int] | None) -> None:
        params.verify()
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if prompt_token_ids is None or not isinstance(prompt, str):
            prompt_token_ids = self.tokenize(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.beam_search.add(request_id, prompt if isinstance(prompt, str) else None, list(prompt_token_ids),
                             params, max_tokens, time.monotonic() if arrival_time is None else arrival_time,
                             cache_salt)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by their user-facing ids; unknown ids are ignored. Frees their KV blocks."""
        for request_id in request_ids:
            if self.beam_search.abort(request_id):
                continue
            child_ids = self._children.get(request_id)
            if child_ids is None:
                continue
            self.output_processor.abort_request(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.structured.free(child_ids)
            del self._children[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.output_processor.record_scheduled(
            [r.request_id for r in scheduler_output.scheduled if r.is_new], time.monotonic()
        )
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except ExecutorDiedError:  # no later step can run: fail every request, then the caller's loop
            self.scheduler.release_step_blocks()
            self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ERROR)
            raise
        except Exception:  # a failing forward must not take the engine down: fail the requests of this step
            logger.exception("model execution failed; failing the %d scheduled requests", len(scheduler_output.scheduled))
            return self._fail_step(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._process(core_outputs)

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        core_outputs, beam_outputs = self.beam_search.process(core_outputs)
        pinned = {o.request_id: o.kv_pinned for o in core_outputs if o.kv_pinned is not None}
        processed = self.output_processor.process_outputs(core_outputs)
        if pinned and self.kv_transfer is not None:  # n = 1: the engine request id is the user-facing one
            for out in processed.request_outputs:
                if out.request_id in pinned:
                    out.kv_transfer_params = self.kv_transfer.response_params(pinned[out.request_id])
        if processed.reqs_to_abort:  # stop strings matched on text
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        for out in processed.request_outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        self.structured.free(self.scheduler.finished_request_ids)  # grammar matchers of ended requests
        return processed.request_outputs + beam_outputs

    def _fail_step(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        ids = [r.request_id for r in scheduler_output.scheduled]
        self.scheduler.release_step_blocks()  # what the step borrowed (update_from_output would have)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return self._process([EngineCoreOutput(request_id=i, new_token_ids=[], finish_reason="error") for i in ids])

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks,
            num_blocks=self.num_kv_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions_total,
            num_fair_share_preemptions=s.num_fair_share_preemptions,
            num_blocks_offloaded=s.offload_counters.num_blocks_offloaded,
            num_blocks_restored=s.offload_counters.num_blocks_restored,
            num_blocks_recomputed=s.offload_counters.num_blocks_recomputed,
            spec_num_drafts=s.spec_stats.num_drafts,
            spec_num_draft_tokens=s.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=s.spec_stats.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=tuple(s.spec_stats.num_accepted_tokens_per_pos),
            spec_num_branches=s.spec_stats.num_branches,
            spec_num_branch_wins=s.spec_stats.num_branch_wins,
            moe_expert_tokens=tuple(sum(b.expert_tokens for b in self._moe_blocks).tolist())
            if self._moe_blocks else (),
            kv_transfer_pinned=len(s.pinned_kv),
            kv_transfer_expired=s.pinned_kv.num_expired_total,
            kv_transfer_pulls=self.kv_transfer.num_pulls if self.kv_transfer is not None else 0,
            kv_transfer_pull_failures=self.kv_transfer.num_pull_failures if self.kv_transfer is not None else 0,
            kv_transfer_blocks_loaded=s.num_kv_blocks_loaded,
            kv_retention_blocks_dropped=getattr(s.kv_cache_manager, "num_retention_blocks_freed", 0),
        )


def _kv_dtype_label(kv_dtype: torch.dtype) -> str:
    """Description of the KV storage for the start-up log, scale granularity included (kv_quant)."""
    return describe_kv_format(kv_dtype)


def _set_num_threads(num_threads: int | None) -> None:
    """One intra-op thread per core unless the user chose (num_threads, or OMP_NUM_THREADS in the environment).

    More threads than free cores is far worse than fewer: OpenMP workers spin-wait on each other.
    """
    if num_threads is None and os.environ.get("OMP_NUM_THREADS"):
        return
    threads = num_threads or os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        logger.warning("num_threads %d is more than the %d CPUs this process may run on: the threads time-share "
                       "cores and wait on each other, which slows every step; use at most %d", threads, cores, cores)
    torch.set_num_threads(threads)
    _warn_if_cores_are_busy(threads)


def _warn_if_cores_are_busy(threads: int) -> None:
    """Log a warning when other work already keeps the cores busy at start-up: OpenMP threads spin-wait for
    each other by default, so two such processes on the same cores wait a scheduler quantum at every one of a
    decode step's ~150 parallel regions (measured on 2 cores: 79 -> 0.8 tok/s with two loom processes; with
    OMP_WAIT_POLICY=passive 58-68 tok/s each, at ~20% cost when alone)."""
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return
    try:
        load = os.getloadavg()[0]
    except OSError:
        return
    cores = os.cpu_count() or 1
    # the 1-minute average lags: just after a benchmark ends it is still high on idle cores, so where the
    # kernel reports them, the tasks runnable right now must agree
    others = _other_runnable_tasks()
    if others is not None and others < 0.5 * cores:
        return
    if threads > 1 and load > 0.75 * cores:
        logger.warning("the CPU is busy (load %.1f on %d cores) and %d OpenMP threads spin-wait by default: "
                       "sharing cores can slow decoding 10-100x; use fewer --num-threads or set "
                       "OMP_WAIT_POLICY=passive (docs/serving.md, 'Shared cores')", load, cores, threads)


def _other_runnable_tasks(samples: int = 5, interval_s: float = 0.01) -> float | None:
    """Mean number of runnable tasks other than this one over `samples` reads of /proc/loadavg's fourth
    field ("running/total", Linux), `interval_s` apart; None where it cannot be read."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(max(running - 1, 0))  # the reading process is running
        if i + 1 < samples:
            time.sleep(interval_s)
    return sum(counts) / len(counts)


def _resolve_max_model_len(requested: int | None, model_max: int) -> int:
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len ({requested}) is larger than the model's context length ({model_max})")
    return requested


__all__ = ["LLMEngine", "EngineStats"]
