"""Frozen engine configuration. Every bad value raises ValueError naming the option."""

from __future__ import annotations

import dataclasses
import math
import logging
from dataclasses import dataclass
from pathlib import Path

from loom.core.kv_retention import KVRetentionConfig
from loom.env import check_switches
from loom.kv_transfer.base import KVTransferConfig
from loom.spec.proposer import SpeculativeConfig

logger = logging.getLogger(__name__)

# EngineArgs fields that only matter while speculation is on
_SPECULATIVE_OPTIONS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                        "speculative_disable_by_batch_size", "suffix_decoding_max_tree_depth",
                        "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                        "suffix_decoding_max_spec_offset", "suffix_decoding_min_token_prob",
                        "speculative_tree_width", "speculative_quantization",
                        "speculative_draft_vocab_size", "speculative_draft_vocab_corpus")

_WARNED: set[str] = set()  # EngineArgs warnings already given in this process

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache storage; "auto" = the model dtype (float16 for packed weights on the CPU, as llama.cpp stores KV).
# int8: asymmetric codes with a float16 scale + min per 32 values of a (token slot, kv head) row; fp8_e4m3: a
# float32 scale per row (docs/kv_cache.md).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
PREEMPTION_MODES = ("recompute", "swap")
# weight quantization methods (loom/quant/config.py): none = dequantize at load (the oracle path)
# block-sparse decode attention (loom/attention/sparse.py): none = every block; topk-blocks = Quest's top-k blocks
SPARSE_ATTENTION_METHODS = ("none", "topk-blocks")
QUANTIZATION_METHODS = ("none", "gguf", "bf16", "w8a16", "w4a16", "w8a8", "fp8", "gptq", "awq")


def _has_gguf_magic(path: Path) -> bool:
    """Whether path is a readable file whose first four bytes are GGUF's magic."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_model_path(model: str) -> Path:
    """`model` as a checkpoint path: it exists, and a directory holds config.json (torch-free: the CLI refuses a
    wrong path before torch and the engine load).

    Raises:
        ValueError: an empty path, a path that does not exist, or a directory without config.json.
    """
    if not str(model).strip():  # Path("") is the working directory
        raise ValueError("model must be a GGUF file or a Hugging Face directory, got an empty path")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json (expected a Hugging Face model directory)")
    return path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None  # GGUF path or Hugging Face model directory; None = bundled SmolLM2-135M-Instruct
    # weights and activations; "auto" = float32 for packed-weight methods on CPU, else bfloat16 where the device has
    # native bf16 matmul, else float32 (loom.worker.model_runner.resolve_dtype)
    dtype: str = "auto"
    max_model_len: int | None = None  # tokens (prompt + output); None = the model's context length
    seed: int = 0  # seed of the engine-wide generator used by unseeded requests
    # weight quantization method (loom/quant/config.py); None = "gguf" for a GGUF file, "none" otherwise
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        # a file that starts with GGUF's magic (the loader reads any file as a GGUF and names a bad magic itself),
        # or a path not there yet that names a .gguf; a directory is a Hugging Face checkpoint; the bundled model
        # is a GGUF file
        path = None if self.model is None else Path(self.model).expanduser()
        gguf = path is None or (not path.exists() and path.suffix.lower() == ".gguf") or _has_gguf_magic(path)
        if gguf and self.quantization in ("gptq", "awq"):  # refused now, not after seconds of loading the file
            article = "an" if self.quantization == "awq" else "a"
            raise ValueError(f"quantization={self.quantization!r} needs {article} {self.quantization.upper()} checkpoint "
                             f"(quantization_config.quant_method {self.quantization!r}); the model is a GGUF file")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 512 * 1024 * 1024  # budget for the paged K/V tensors, bytes
    num_blocks: int | None = None  # overrides the budget when set (tests use it to force pressure)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of SUPPORTED_KV_CACHE_DTYPES
    kv_offload_memory_bytes: int = 0  # host tier for evicted / swapped-out blocks, bytes; 0 = no host tier
    # models that mix sliding-window and global layers (Gemma 2 / 3): one block table per KV cache group, so the
    # sliding layers hold only their window (loom/core/kv_groups.py); False = one table, every layer every block
    hybrid_kv_cache: bool = True
    # which KV blocks a long request keeps under a budget (loom/core/kv_retention.py); per request overridable
    kv_retention: KVRetentionConfig = KVRetentionConfig()
    sparse_attention: str = "none"  # one of SPARSE_ATTENTION_METHODS
    sparse_attention_topk: int = 64  # topk-blocks: blocks chosen by their score bound per decode query
    sparse_attention_sink_blocks: int = 1  # topk-blocks: first blocks always read
    sparse_attention_recent_blocks: int = 2  # topk-blocks: last blocks always read (the partial one included)

    def __post_init__(self) -> None:
        if self.sparse_attention not in SPARSE_ATTENTION_METHODS:
            raise ValueError(f"sparse_attention must be one of {list(SPARSE_ATTENTION_METHODS)}, got "
                             f"{self.sparse_attention!r}")
        for name, low in (("sparse_attention_topk", 1), ("sparse_attention_sink_blocks", 0),
                          ("sparse_attention_recent_blocks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_offload_memory_bytes < 0:
            raise ValueError(f"kv_offload_memory_bytes must be >= 0, got {self.kv_offload_memory_bytes}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 64  # most requests running at once
    max_model_len: int = 2048  # tokens; filled in from the model when the user gives none
    max_waiting_requests: int | None = None  # bound on the waiting queue (server back-pressure); None = unbounded
    preemption_mode: str = "recompute"  # "swap": a preempted request's blocks go to the host tier and come back

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks that split every weight matrix (1 = the whole model in this process)
    pipeline_parallel_size: int = 1  # stages the layers are split into, each tensor_parallel_size ranks
    pipeline_microbatches: int = 2  # most micro-batches a step is cut into, so the stages work at once
    enable_expert_parallel: bool = False  # MoE: whole experts spread over the tensor-parallel ranks, tokens sent to them
    distributed_timeout_s: float = 300.0  # a collective waiting longer than this fails the step (a stuck worker)
    # ranks that split a long prompt's prefill by position (ring attention; loom/distributed/context_parallel.py),
    # each holding the whole model and the whole KV cache
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_microbatches",
                     "context_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_microbatches != 2 and self.pipeline_parallel_size == 1:
            logger.warning("pipeline_microbatches: no effect without pipeline_parallel_size > 1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel spreads the experts over the tensor-parallel ranks: set "
                             "tensor_parallel_size > 1")
        if not (math.isfinite(self.distributed_timeout_s) and self.distributed_timeout_s > 0):
            raise ValueError(f"distributed_timeout_s must be a finite number of seconds > 0, got "
                             f"{self.distributed_timeout_s}")
        if self.context_parallel_size > 1 and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError("context_parallel_size > 1 with tensor_parallel_size or pipeline_parallel_size > 1 is not "
                             "supported yet: context parallelism runs with whole-model ranks")

    def describe_sizes(self) -> str:
        """The sizes above 1, for messages: e.g. "tensor_parallel_size > 1" or "tensor_parallel_size /
        pipeline_parallel_size > 1" ("" when none is)."""
        names = [n for n in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
                 if getattr(self, n) > 1]
        return f"{' / '.join(names)} > 1" if names else ""

    @property
    def world_size(self) -> int:
        """Processes in all: tensor_parallel_size * pipeline_parallel_size * context_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


MAX_MEMORY_GB = float(1 << 30)  # an exbibyte: above any machine, below an overflow of the byte count


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything a user can set, flat, as the CLI and `LLM(...)` take it."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # none | gguf | w8a16 | w4a16 | w8a8 | fp8; None = gguf for a GGUF file
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_memory_gb: float = 0.5  # GiB for the paged K/V tensors
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True  # Gemma 2 / 3: a block table per KV cache group, sliding layers hold their window
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_waiting_requests: int | None = None
    num_threads: int | None = None  # torch intra-op threads; None = number of cores
    kv_cache_dtype: str = "auto"  # KV storage: auto (= dtype; float16 for packed CPU weights) | float32 | bfloat16 | float16 | int8 | fp8_e4m3
    kv_offload_memory_gb: float = 0.0  # GiB of host memory for offloaded KV blocks; 0 = no host tier
    preemption_mode: str = "recompute"  # recompute | swap (needs kv_offload_memory_gb > 0)
    speculative_method: str | None = None  # ngram; None = no speculative decoding (loom/spec)
    num_speculative_tokens: int = 4  # most draft tokens per request and step
    prompt_lookup_min: int = 2  # ngram: shortest suffix that may match (tokens)
    prompt_lookup_max: int = 4  # ngram: longest suffix, tried first (tokens)
    speculative_disable_by_batch_size: int | None = 3  # no drafts while >= this many requests run; None = never
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest substring the suffix trees count (tokens)
    suffix_decoding_max_cached_requests: int = 128  # suffix: earlier outputs in the global tree; 0 = none
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: drafts <= factor * match length + offset
    suffix_decoding_max_spec_offset: float = 0.0
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop drafting below this estimated probability
    speculative_tree_width: int = 1  # ngram/suffix: most candidate branches per greedy request and step
    speculative_model: str | None = None  # draft_model: the draft's GGUF file or Hugging Face directory
    speculative_quantization: str | None = None  # draft_model: the draft's --quantization; None = the target's
    # draft_model: the draft's LM head computes only this many most frequent tokens' logits (FR-Spec); None = all
    speculative_draft_vocab_size: int | None = None
    speculative_draft_vocab_corpus: str | None = None  # ... counted on this file or directory; None = Python's stdlib
    tensor_parallel_size: int = 1  # processes that split every weight matrix (loom/executor/multiproc.py)
    pipeline_parallel_size: int = 1  # stages the layers are split into (loom/distributed/pipeline_parallel.py)
    pipeline_microbatches: int = 2  # pipeline parallel: most micro-batches a step is cut into
    enable_expert_parallel: bool = False  # MoE: experts spread whole over the tensor-parallel ranks (all-to-all)
    distributed_timeout_s: float = 300.0  # tensor parallel: a collective stuck longer than this fails the engine
    context_parallel_size: int = 1  # ranks that split a long prompt's prefill by position (ring attention)
    # prefill/decode disaggregation (loom/kv_transfer, docs/disaggregation.md): producer | consumer | both; None = off
    kv_transfer_role: str | None = None
    kv_connector: str = "tcp"  # the KV connector (loom.kv_transfer.base.KV_CONNECTORS)
    kv_transfer_host: str = "127.0.0.1"  # producer: address its KV server listens on and advertises
    kv_transfer_port: int = 0  # producer: KV server port; 0 = any free port
    kv_transfer_timeout_s: float = 120.0  # producer: seconds unread prompt blocks stay pinned
    kv_transfer_pull_timeout_s: float = 10.0  # consumer: seconds a pull may take before computing the prompt
    kv_transfer_peers: tuple[str, ...] = ("127.0.0.1", "::1", "localhost")  # consumer: hosts it may pull from
    # long context (docs/long_context.md): KV retention policy and budget (loom/core/kv_retention.py)
    kv_retention: str = "full"  # full | sinks | h2o | snapkv
    kv_retention_budget: float = 0.25  # <= 1: fraction of the prompt's tokens; > 1: tokens
    kv_retention_sink_tokens: int = 4  # first tokens always kept (sinks, h2o)
    kv_retention_window: int = 32  # recent tokens always kept; snapkv's observation window
    sparse_attention: str = "none"  # none | topk-blocks (block-sparse decode attention, Quest)
    sparse_attention_topk: int = 64  # topk-blocks: blocks read per decode query, besides sinks and recent ones
    sparse_attention_sink_blocks: int = 1
    sparse_attention_recent_blocks: int = 2

    def __post_init__(self) -> None:
        check_switches()  # a bad LOOM_* on/off value fails here, before a model loads (the CLI checks it too)
        # the speculative options are checked even while speculation is off, so a typo is not silently ignored
        method = self._method()
        # off: the rest validated as ngram's, the options only a draft model reads warned of below
        self._speculative_config(method or "ngram", draft_options=method is not None)
        if method is None:
            defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
            unused = [name for name in _SPECULATIVE_OPTIONS if getattr(self, name) != defaults[name]]
            message = f"{', '.join(unused)}: no effect without speculative_method (speculation is off)"
            if unused and message not in _WARNED:  # once: the CLI and LLM() each build EngineArgs from the same flags
                _WARNED.add(message)
                logger.warning("%s", message)
        for name in ("kv_cache_memory_gb", "kv_offload_memory_gb"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of GiB, got {getattr(self, name)}")
            if getattr(self, name) > MAX_MEMORY_GB:  # its bytes would overflow; the machine's size is checked later
                raise ValueError(f"{name} must be at most {MAX_MEMORY_GB} GiB, got {getattr(self, name)}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_offload_memory_gb < 0:
            raise ValueError(f"kv_offload_memory_gb must be >= 0, got {self.kv_offload_memory_gb}")
        if self.preemption_mode == "swap" and self.kv_offload_memory_gb == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set kv_offload_memory_gb > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        parallel = self.parallel_config()
        self.cache_config()  # validates the KV retention and sparse attention options
        # the scheduler's limits, before any model loads (max_model_len itself is resolved against the model later)
        self.scheduler_config(1 if self.max_model_len is None else self.max_model_len)
        if self.kv_retention != "full":
            for conflict, on in (("preemption_mode='swap'", self.preemption_mode == "swap"),
                                 ("kv_transfer_role", self.kv_transfer_role is not None),
                                 (parallel.describe_sizes(), parallel.world_size > 1),
                                 ("speculative decoding", self._method() is not None)):
                if on:
                    raise ValueError(f"kv_retention={self.kv_retention!r} with {conflict} is not supported yet")
        if parallel.world_size > 1 and self.sparse_attention != "none":
            raise ValueError(f"sparse_attention with {parallel.describe_sizes()} is not supported yet")
        if self.kv_transfer_config() is not None and parallel.world_size > 1:
            raise ValueError(f"kv_transfer_role with {parallel.describe_sizes()} is not supported yet (the blocks "
                             "live on every rank)")
        if parallel.world_size > 1 and self._method() == "draft_model":
            raise ValueError(f"{parallel.describe_sizes()} with a draft model is not supported yet (the draft "
                             "would run on rank 0 alone); use speculative_method ngram or suffix")
        if parallel.world_size > 1 and self.speculative_tree_width > 1:
            raise ValueError(f"speculative_tree_width > 1 with {parallel.describe_sizes()} is not supported yet "
                             "(rank 0 alone knows which branch won, the other ranks' caches would miss its rows)")

    def kv_transfer_config(self) -> KVTransferConfig | None:
        """This replica's part in prefill/decode disaggregation, or None when off. Raises ValueError naming the
        option."""
        if self.kv_transfer_role is None:
            return None
        return KVTransferConfig(role=self.kv_transfer_role, connector=self.kv_connector, host=self.kv_transfer_host,
                                port=self.kv_transfer_port, timeout_s=self.kv_transfer_timeout_s,
                                pull_timeout_s=self.kv_transfer_pull_timeout_s,
                                peers=tuple(self.kv_transfer_peers))

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              pipeline_microbatches=self.pipeline_microbatches,
                              enable_expert_parallel=self.enable_expert_parallel,
                              distributed_timeout_s=self.distributed_timeout_s,
                              context_parallel_size=self.context_parallel_size)

    def model_config(self) -> ModelConfig:
        return ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                           quantization=self.quantization)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=int(self.kv_cache_memory_gb * (1 << 30)),
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            hybrid_kv_cache=self.hybrid_kv_cache,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offload_memory_bytes=int(self.kv_offload_memory_gb * (1 << 30)),
            kv_retention=self.kv_retention_config(),
            sparse_attention=self.sparse_attention,
            sparse_attention_topk=self.sparse_attention_topk,
            sparse_attention_sink_blocks=self.sparse_attention_sink_blocks,
            sparse_attention_recent_blocks=self.sparse_attention_recent_blocks,
        )

    def kv_retention_config(self) -> KVRetentionConfig:
        """The engine's KV retention settings. Raises ValueError naming the option."""
        return KVRetentionConfig(policy=self.kv_retention, budget=self.kv_retention_budget,
                                 sink_tokens=self.kv_retention_sink_tokens, window=self.kv_retention_window)

    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, or None when speculation is off. A speculative_model without a
        method means draft_model (as vLLM infers the method from its speculative config's model)."""
        method = self._method()
        return None if method is None else self._speculative_config(method)

    def _method(self) -> str | None:
        return self.speculative_method or ("draft_model" if self.speculative_model else None)

    def _speculative_config(self, method: str, draft_options: bool = True) -> SpeculativeConfig:
        return SpeculativeConfig(
            method=method, num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
            disable_by_batch_size=self.speculative_disable_by_batch_size,
            suffix_max_tree_depth=self.suffix_decoding_max_tree_depth,
            suffix_max_cached_requests=self.suffix_decoding_max_cached_requests,
            suffix_max_spec_factor=self.suffix_decoding_max_spec_factor,
            suffix_max_spec_offset=self.suffix_decoding_max_spec_offset,
            suffix_min_token_prob=self.suffix_decoding_min_token_prob,
            model=self.speculative_model, quantization=self.speculative_quantization if draft_options else None,
            draft_vocab_size=self.speculative_draft_vocab_size if draft_options else None,
            draft_vocab_corpus=self.speculative_draft_vocab_corpus if draft_options else None,
            tree_width=self.speculative_tree_width)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            max_waiting_requests=self.max_waiting_requests,
            preemption_mode=self.preemption_mode,
        )


__all__ = [
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "EngineArgs",
    "SUPPORTED_DTYPES",
    "SUPPORTED_KV_CACHE_DTYPES",
    "PREEMPTION_MODES",
    "QUANTIZATION_METHODS",
]
