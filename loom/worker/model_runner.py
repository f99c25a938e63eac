"""SchedulerOutput -> input tensors -> forward -> sample -> ModelRunnerOutput. All tensors live here."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loom.attention.metadata import AttentionMetadata
from loom.attention.sparse import SparseAttentionConfig, copied_block_ids, stale_key_summaries
from loom.attention.kv_scores import KVScoreCollector
from loom.config import CacheConfig, ModelConfig
from loom.distributed.context_parallel import ContextParallel, ContextParallelStep
from loom.distributed.pipeline_parallel import PipelineParallel, split_microbatches
from loom.distributed.tensor_parallel import TensorParallel, max_kv_heads_per_rank, partition
from loom.core.kv_groups import KVCacheGroup, kv_cache_groups, layer_slots
from loom.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from loom.model.huge_pages import huge_pages_available, log_placement
from loom.model.llama import SparseMoeBlock
from loom.model.loader import load_model
from loom.sample.structured import StructuredOutputManager
from loom.sample.sampler import SamplingInput, compute_token_logprobs, sample
from loom.spec.verify import accept_sampled
from loom.attention.kv_quant import resolve_kv_cache_dtype
from loom.kv_transfer.tensors import write_blocks
from loom.worker.kv_cache import (
    allocate_kv_caches,
    copy_kv_slots,
    kv_cache_bytes_per_token,
    num_blocks_for_budget,
)
from loom.worker.kv_offload import HostKVCache, num_host_blocks_for_budget

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Methods whose CPU kernels read the weights at their own width and take float32 activations (loom/kernels/csrc/
# qgemm.c quantizes them per block itself; gemv_fp8.c multiplies them as they are): the activation dtype changes
# none of the bytes a step reads.
PACKED_CPU_METHODS = ("gguf", "w8a16", "w4a16", "w8a8", "gptq", "awq", "fp8")


def resolve_dtype(name: str, device: torch.device, quantization: str | None = None,
                  model: str | None = None) -> torch.dtype:
    """Weights/activations dtype of a ModelConfig.dtype name.

    "auto" is bfloat16 where the device multiplies bfloat16 natively (a CPU listing avx512_bf16 or amx_bf16,
    see bf16_is_fast, or a CUDA device of compute capability >= 8.0), float32 elsewhere. bfloat16 halves the weight
    bytes every decode step reads (the roofline floor in benchmarks/NOTES.md). Logits are cast to float32
    before sampling (as transformers does); RMSNorm statistics and rotary run in float32 and SDPA
    accumulates its softmax in float32. Pass "float32" for exact transformers parity.

    On CPU a packed-weight method (PACKED_CPU_METHODS; `quantization` None means the checkpoint's default,
    loader.default_quantization: "gguf" for a GGUF `model`, the bundled one included) makes "auto" float32:
    its weights are read at their own width whatever the activations are, so bfloat16 would only add its
    rounding. Measured on a Sapphire Rapids-class CPU
    (benchmarks/BENCHMARKS.md, 2026-12-02): the bundled Q4_1 model agreed with the dequantized float32 model's
    top-1 token on 97.8% of held-out positions in bfloat16 and 99.98% in float32, at the same decode speed.
    """
    method = quantization
    if device.type == "cpu" and method is None:  # the checkpoint's own (read once: it may open the file)
        from loom.model.loader.model_loader import default_quantization

        method = default_quantization(model)
    if name == "float16" and device.type == "cpu" and method in PACKED_CPU_METHODS:
        raise ValueError(f"dtype float16 with quantization {method} on the CPU: its kernels take float32 or "
                         "bfloat16 activations; use dtype auto, float32 or bfloat16 (or quantization none)")
    if name != "auto":
        return _DTYPES[name]
    if method is not None and packed_on_cpu(device, method, model):
        return torch.float32
    return torch.bfloat16 if bf16_is_fast(device) else torch.float32


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, bytes; None where the system does not say (not POSIX)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_memory(device: torch.device, kv_bytes: int, host_bytes: int) -> None:
    """Refuse KV caches larger than the memory that would hold them, before allocating: the device's KV cache
    (kv_bytes; on the CPU, together with the host tier) against the machine's physical memory or the GPU's.
    An allocation past it fails with the allocator's own error, or (Linux overcommit) succeeds and the process
    is killed when the pages are touched.

    Raises:
        ValueError: naming kv_cache_memory_gb / num_kv_blocks or kv_offload_memory_gb, with both sizes in GiB.
    """
    gib = 1 << 30
    physical = physical_memory_bytes()
    if torch.device(device).type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        if kv_bytes > total:
            raise ValueError(f"kv_cache_memory_gb / num_kv_blocks: a KV cache of {kv_bytes / gib:.2f} GiB is larger "
                             f"than the GPU's {total / gib:.2f} GiB")
        kv_bytes = 0  # the host tier alone is in the machine's memory
    if physical is None:
        return
    if kv_bytes > physical:
        raise ValueError(f"kv_cache_memory_gb / num_kv_blocks: a KV cache of {kv_bytes / gib:.2f} GiB is larger than "
                         f"this machine's {physical / gib:.2f} GiB of memory")
    if kv_bytes + host_bytes > physical:
        raise ValueError(f"kv_offload_memory_gb: a host tier of {host_bytes / gib:.2f} GiB beside a KV cache of "
                         f"{kv_bytes / gib:.2f} GiB is larger than this machine's {physical / gib:.2f} GiB of memory")


def packed_on_cpu(device: torch.device, quantization: str | None, model: str | None) -> bool:
    """True when the weights run packed on the CPU: a PACKED_CPU_METHODS method (`quantization` None = the
    checkpoint's default, "gguf" for a GGUF file) on a CPU device; fp8 only where loom's gemv_fp8 kernel runs
    (without it the fp8 values are widened at load, a dense model: bfloat16 where the CPU has it halves the bytes)."""
    if device.type != "cpu":
        return False
    method = quantization
    if method is None:
        from loom.model.loader.model_loader import default_quantization

        method = default_quantization(model)
    if method == "fp8":
        from loom.kernels.registry import get_kernel

        return get_kernel("gemv_fp8") is not None
    return method in PACKED_CPU_METHODS


# x86 flags of a CPU that multiplies bfloat16 itself (Zen 4, Cooper Lake, Sapphire Rapids and later)
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_is_fast(device: torch.device) -> bool:
    """True when bfloat16 matmuls run natively on `device` (not emulated through float32).

    On an x86 CPU that takes one of _NATIVE_BF16_FLAGS: oneDNN's own check also says yes on plain AVX-512
    (emulated, by conversion), where bfloat16 activations ran a bf16 checkpoint at 25.7 tok/s against 53 with
    float32 ones on an Ice Lake-class CPU (the C decode step and gemv_w16 take float32 activations). Where the
    kernel lists no flags (not Linux x86), oneDNN's check decides."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        from loom.kernels.build import cpu_flags

        flags = cpu_flags()
        if flags and not flags & _NATIVE_BF16_FLAGS:
            return False
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


@dataclass(slots=True)
class _StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata | list[AttentionMetadata]  # one, or each layer's (a hybrid KV cache)
    sample_indices: list[int]  # [num_sampling_reqs] row of the flattened batch whose logits are sampled
    sample_reqs: list[ScheduledRequest]  # requests that sample this step, same order
    prompt_lp_indices: list[int]  # rows whose logits give prompt logprobs
    prompt_lp_targets: list[int]  # the prompt token each such row predicts
    prompt_lp_owners: list[tuple[str, int, int, int]]  # (request_id, first entry, num entries, top-N) into the lists above


class ModelRunner:
    """Owns the model, the paged KV tensors and the generator of unseeded samples."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                 tp: TensorParallel | None = None, pp: PipelineParallel | None = None,
                 cp: ContextParallel | None = None) -> None:
        """tp: this process's rank in a tensor-parallel group (it holds its shard of the weights and the KV heads
        of its attention heads); pp: its pipeline stage (its layers and their KV caches); cp: its place in a
        context-parallel ring (the whole model and KV cache, a share of each prefill step); None = the whole model
        and every row. Only the driver (rank 0 of each kind) samples.

        Raises:
            ValueError: a pipeline stage with a hybrid KV cache or a host tier, or context parallelism with a hybrid
                KV cache (not supported yet), or as load_model.
        """
        self.device = device
        self.tp = tp
        self.pp = pp
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.is_driver = ((tp is None or tp.rank == 0) and (pp is None or pp.is_first)
                          and (self.cp is None or self.cp.rank == 0))
        if pp is not None and cache_config.kv_offload_memory_bytes:
            raise ValueError("kv_offload_memory: the host tier is not supported with pipeline parallelism yet")
        self.dtype = resolve_dtype(model_config.dtype, device, model_config.quantization, model_config.model)
        loaded = load_model(model_config.model, self.dtype, device, quantization=model_config.quantization, tp=tp,
                            pp=pp, sparse_attention=SparseAttentionConfig.from_cache_config(cache_config))
        self.model = loaded.model
        self.moe_blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]  # routing counts
        self.attn_backend = loaded.attn_backend
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.model_path = loaded.model_path
        self.block_size = cache_config.block_size
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            cache_config.kv_cache_dtype, self.dtype,
            packed_cpu=packed_on_cpu(device, model_config.quantization, model_config.model))
        # the KV heads held here; blocks are counted for the rank holding the most, so a block id is a block on every
        # rank (the scheduler's ids mean the same everywhere)
        # (and, under pipeline parallelism, for the stage holding the most layers)
        attn = self.model.model.layers[0 if pp is None else pp.layer_start].self_attn
        local_arch = self.arch if tp is None else dataclasses.replace(
            self.arch, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)
        most_kv = max_kv_heads_per_rank(self.arch.num_heads, self.arch.num_kv_heads, 1 if tp is None else tp.size)
        most_layers = self.arch.num_layers if pp is None else -(-self.arch.num_layers // pp.size)
        budget_arch = dataclasses.replace(self.arch, num_kv_heads=most_kv, num_layers=most_layers,
                                          num_heads=most_kv * (self.arch.num_heads // self.arch.num_kv_heads),
                                          layer_types=None)
        self.kv_bytes_per_token = kv_cache_bytes_per_token(budget_arch, self.kv_cache_dtype)
        # KV cache groups: one for a model whose layers attend alike; Gemma's sliding and global layers get a block
        # table per group (loom/core/kv_groups.py) unless the hybrid KV cache is switched off
        windows = [self.arch.layer_sliding_window(i) for i in range(self.arch.num_layers)]
        groups = kv_cache_groups(windows)
        if len(groups) > 1 and not cache_config.hybrid_kv_cache:
            groups = [KVCacheGroup(tuple(range(self.arch.num_layers)), None)]
        self.kv_groups: list[KVCacheGroup] = groups
        hybrid = len(groups) > 1
        if hybrid and pp is not None:
            raise ValueError("pipeline parallelism with a hybrid sliding-window KV cache (Gemma 2 / 3) is not "
                             "supported yet; switch it off with --no-hybrid-kv-cache")
        if hybrid and self.cp is not None:
            raise ValueError("context parallelism with a hybrid sliding-window KV cache (Gemma 2 / 3) is not "
                             "supported yet; switch it off with --no-hybrid-kv-cache")
        if hybrid and cache_config.kv_offload_memory_bytes:
            raise ValueError("kv_offload_memory: the host tier is not supported with the hybrid sliding-window KV "
                             "cache of this model (switch it off with --no-hybrid-kv-cache, or offload nothing)")
        self.group_of_layer, slots = layer_slots(groups, self.arch.num_layers)
        self.num_blocks = cache_config.num_blocks or num_blocks_for_budget(
            budget_arch, self.kv_cache_dtype, cache_config.block_size, cache_config.kv_cache_memory_bytes,
            layers_per_block=len(groups[0].layers) if hybrid else None,
        )
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gb is too small for one block of {cache_config.block_size} tokens "
                f"({self.kv_bytes_per_token * cache_config.block_size} bytes)"
            )
        self.num_host_blocks = num_host_blocks_for_budget(
            budget_arch, self.kv_cache_dtype, self.block_size, cache_config.kv_offload_memory_bytes
        )
        kv_bytes = self.num_blocks * cache_config.block_size * self.kv_bytes_per_token
        host_bytes = self.num_host_blocks * cache_config.block_size * self.kv_bytes_per_token
        check_fits_in_memory(device, kv_bytes, host_bytes)
        try:
            self.kv_caches = allocate_kv_caches(local_arch, self.num_blocks, self.block_size, self.kv_cache_dtype,
                                                device, layer_slots=slots if hybrid else None,
                                                held=None if pp is None else range(pp.layer_start, pp.layer_stop))
        except (OSError, RuntimeError) as exc:  # the allocator's own words (ENOMEM, CUDA out of memory)
            raise ValueError(f"the KV cache of {self.num_blocks} blocks ({kv_bytes / (1 << 30):.2f} GiB) could not "
                             f"be allocated: lower kv_cache_memory_gb or num_kv_blocks ({exc})") from exc
        # allocate_kv_caches put CPU caches on huge pages when they are available (zeros_on_huge_pages)
        kv_on_huge_pages = torch.device(device).type == "cpu" and huge_pages_available()
        log_placement(getattr(self.model, "huge_page_bytes", 0), sum(
            c.nbytes for c in {id(c): c for c in self.kv_caches}.values()) if kv_on_huge_pages else 0)
        try:
            self.host_kv_cache = HostKVCache(self.kv_caches, self.num_host_blocks) if self.num_host_blocks else None
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"the host KV tier of {self.num_host_blocks} blocks ({host_bytes / (1 << 30):.2f} GiB) "
                             f"could not be allocated: lower kv_offload_memory_gb ({exc})") from exc
        self.default_generator = torch.Generator().manual_seed(model_config.seed)  # unseeded rows' uniforms
        # pipeline stage: seconds computing (its layers, and the logits on the last stage) and seconds in steps, so
        # 1 - busy / step is this stage's bubble fraction (benchmarks/parallel_bench.py)
        self.pipeline_busy_s = 0.0
        self.pipeline_step_s = 0.0
        # the step in progress has passed its last collective (under model parallelism an error after that point is
        # rank 0's alone and fails only that step; before it, the ranks are out of step)
        self.step_collectives_done = False
        self.context_parallel_steps = 0  # steps this rank ran as a share of the context-parallel ring
        self.structured: StructuredOutputManager | None = None  # set by the engine; grammar masks per request

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.step_collectives_done = False
        self._copy_host_blocks(scheduler_output)
        self._copy_blocks(scheduler_output.blocks_to_copy)
        for load in scheduler_output.kv_loads:  # pulled prompt blocks (disaggregated decode)
            write_blocks(self.kv_caches, load.payload, load.src_indices, load.dst_block_ids)
        self._copy_branch_context(scheduler_output.scheduled)
        # block-sparse attention: the key summaries of the blocks just copied into are stale
        stale_key_summaries(self.attn_backend, copied_block_ids(scheduler_output, self.block_size))
        output = ModelRunnerOutput(sampled_token_ids={})
        if scheduler_output.is_empty:
            self.step_collectives_done = True
            return output
        if self.pp is not None:
            return self._execute_pipeline_stage(scheduler_output.scheduled)
        if self.cp is not None:
            split = self._context_parallel_splits(scheduler_output.scheduled)
            if any(split):
                return self._execute_context_parallel(scheduler_output.scheduled, split, output)
        inputs = self._prepare_inputs(scheduler_output.scheduled)
        # (a context-parallel rank runs the steps it does not split whole, as every rank does, so that its KV cache
        # stays the same as rank 0's)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if self.cp is not None and not self.is_driver:
            self.step_collectives_done = True
            return output  # no logits: they involve no other rank
        prompt_lp_logits, sample_logits = self._logits(hidden, inputs)  # every tensor-parallel rank: a collective
        self.step_collectives_done = True  # what follows is rank 0's alone
        if not self.is_driver:
            return output  # the sampling is rank 0's alone
        meta = inputs.attn_metadata
        if isinstance(meta, AttentionMetadata) and meta.kv_scores is not None:
            output.kv_block_scores = meta.kv_scores.result()
        return self._finish_step(prompt_lp_logits, sample_logits, inputs, output)

    def _finish_step(self, prompt_lp_logits: torch.Tensor | None, sample_logits: torch.Tensor | None,
                     inputs: _StepInputs, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Rank 0's end of a step: the prompt logprobs and the sampled tokens of `inputs`' rows, into `output`."""
        if prompt_lp_logits is not None:
            self._add_prompt_logprobs(prompt_lp_logits, inputs, output)
        if sample_logits is not None:
            self._sample(sample_logits, inputs.sample_reqs, output)
        return output

    def _context_parallel_splits(self, scheduled: list[ScheduledRequest]) -> list[bool]:
        """Which requests of the step a context-parallel engine splits over its ring: plain prefill chunks (no
        verify or decode rows, no KV retention scoring) of at least two tokens per rank (the zigzag split's 2N parts
        each non-empty). The rest run whole on every rank, so that every rank's KV cache stays the same as rank 0's.
        Every rank decides alike from the same scheduler output."""
        assert self.cp is not None
        return [not r.spec_token_ids and not r.spec_branches and not r.decode_rows and not r.kv_score_rows
                and not r.group_block_tables and r.num_dropped_tokens == 0 and len(r.token_ids) >= 2 * self.cp.size
                for r in scheduled]

    def _execute_context_parallel(self, scheduled: list[ScheduledRequest], split: list[bool],
                                  output: ModelRunnerOutput) -> ModelRunnerOutput:
        """A step whose prefill chunks are split over the context-parallel ring (ContextParallelStep): of each split
        chunk cut into 2N parts, rank r runs parts r and 2N - 1 - r (the zigzag split, which balances the causal
        attention pairs), and the step's other rows whole; its attention layers exchange the split chunks' K/V round
        the ring, and the output rows are gathered so that rank 0 computes the logits and samples exactly as for the
        whole step."""
        cp = self.cp
        assert cp is not None
        whole = self._prepare_inputs(scheduled)  # the step's rows in batch order: what sampling indexes
        meta = whole.attn_metadata
        assert isinstance(meta, AttentionMetadata)
        first_row = [0]  # each request's first row in the whole step (no tree branches under model parallelism)
        for req in scheduled:
            first_row.append(first_row[-1] + len(req.token_ids))
        parts = 2 * cp.size
        # runs[rank][i]: [early part, late part] offsets within request i's chunk, or None where it runs whole
        runs = [[[partition(len(r.token_ids), parts, rank), partition(len(r.token_ids), parts, parts - 1 - rank)]
                 if split[i] else None for i, r in enumerate(scheduled)] for rank in range(cp.size)]
        slots = [torch.cat([meta.slot_mapping[first_row[i] + a : first_row[i] + b]
                            for i, request_runs in enumerate(rank_runs) if request_runs is not None
                            for a, b in request_runs])
                 for rank_runs in runs]
        local_scheduled: list[ScheduledRequest] = []
        for req, request_runs in zip(scheduled, runs[cp.rank], strict=True):
            if request_runs is None:
                local_scheduled.append(req)
            else:  # its two parts as two chunks of the request (each attends up to its own last row)
                local_scheduled.extend(dataclasses.replace(req, token_ids=req.token_ids[a:b],
                                                           start_position=req.start_position + a)
                                       for a, b in request_runs)
        local = self._prepare_inputs(local_scheduled)
        pieces: list[tuple[str, Any, Any]] = []
        exchange: list[int] = []
        longrope_ends: list[int] = []
        local_row = 0
        exchanged_before = [0] * cp.size  # per rank: its exchanged rows of the requests before this one
        for i, req in enumerate(scheduled):
            n = len(req.token_ids)
            if split[i]:
                early = [runs[rank][i][0][1] - runs[rank][i][0][0] for rank in range(cp.size)]
                late = [runs[rank][i][1][1] - runs[rank][i][1][0] for rank in range(cp.size)]
                # the chunk's parts in position order: ranks' early parts 0 .. N - 1, then late parts N - 1 .. 0
                order = ([(rank, exchanged_before[rank], early[rank]) for rank in range(cp.size)]
                         + [(rank, exchanged_before[rank] + early[rank], late[rank])
                            for rank in reversed(range(cp.size))])
                pieces.append(("split", order, None))
                exchanged_before = [e + a + b for e, a, b in zip(exchanged_before, early, late, strict=True)]
                mine = early[cp.rank] + late[cp.rank]
                exchange.extend(range(local_row, local_row + mine))
                longrope_ends.extend([req.start_position + n - 1] * 2)  # both parts: the chunk's last token decides
                local_row += mine
            else:
                pieces.append(("whole", local_row, n))
                entries = n if req.spec_token_ids or req.decode_rows else 1  # rows of their own, or one chunk
                longrope_ends.extend(range(req.start_position + n - entries, req.start_position + n))
                local_row += n
        plan = ContextParallelStep(
            cp, slots,
            None if len(exchange) == local_row else torch.tensor(exchange, dtype=torch.int64, device=self.device),
            pieces, longrope_ends)
        local_meta = local.attn_metadata
        assert isinstance(local_meta, AttentionMetadata)
        moe = self.moe_blocks
        before = [m.expert_tokens.clone() for m in moe]
        for m in moe:  # the other ranks count their split rows only (rank 0 counts the rows every rank runs)
            m.counted_rows = None if cp.rank == 0 else plan.exchange_rows
        try:
            hidden = self.model(local.input_ids, local.positions, self.kv_caches,
                                dataclasses.replace(local_meta, context_parallel=plan))
        finally:
            for m in moe:
                m.counted_rows = None
        hidden = plan.gather_rows(hidden)
        if moe:  # rank 0's routing counts gain the other ranks' split rows (load-balance metrics)
            counts = torch.stack([m.expert_tokens - b for m, b in zip(moe, before, strict=True)])
            if cp.rank == 0:
                counts.zero_()
            dist.all_reduce(counts, group=cp.group)
            if cp.rank == 0:
                for m, added in zip(moe, counts, strict=True):
                    m.expert_tokens += added
        self.context_parallel_steps += 1
        self.step_collectives_done = True  # what follows is rank 0's alone
        if not self.is_driver:
            return output
        return self._finish_step(*self._logits(hidden, whole), whole, output)

    def _logits(self, hidden: torch.Tensor, inputs: _StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [rows, vocab_size] float32 of the prompt-logprob rows and of the sampled rows (None where none)."""
        rows = inputs.sample_indices
        if not inputs.prompt_lp_indices and len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
            # a decode step (every row sampled, in order: indices are increasing): no gather
            return None, self.model.compute_logits(hidden)
        out = []
        for rows in (inputs.prompt_lp_indices, inputs.sample_indices):
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            out.append(self.model.compute_logits(hidden[index]) if rows else None)
        return out[0], out[1]

    def _execute_pipeline_stage(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """This stage's part of a step: its requests cut into micro-batches that flow through the stages one after
        the other (while this stage runs micro-batch j, the next runs j - 1). The last stage computes the logits and
        sends them to rank 0, which samples after its own stage has sent every micro-batch on."""
        pp = self.pp
        assert pp is not None
        started = time.perf_counter()
        ranges = split_microbatches([len(r.token_ids) for r in scheduled], pp.num_microbatches)
        sample_logits: list[torch.Tensor] = []
        batches = [self._prepare_inputs(scheduled[a:b]) for a, b in ranges]
        sending: list[tuple[Any, torch.Tensor]] = []  # (request, tensor kept alive until it is sent)
        for inputs in batches:
            intermediate = None
            if not pp.is_first:
                n = inputs.input_ids.shape[0]
                intermediate = (torch.empty(n, self.arch.hidden_size, dtype=self.dtype, device=self.device),
                                torch.empty(n, self.arch.hidden_size, dtype=self.dtype, device=self.device))
                pp.recv_prev(list(intermediate))
            busy = time.perf_counter()
            out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, intermediate)
            if not pp.is_last:
                tensors = [t.contiguous() for t in out]
                self.pipeline_busy_s += time.perf_counter() - busy
                sending.extend(zip(pp.send_next(tensors), tensors, strict=True))
                continue
            all_logits = self._logits(out, inputs)
            self.pipeline_busy_s += time.perf_counter() - busy
            for logits in all_logits:
                if logits is not None and pp.tp_rank == 0:
                    sending.append((dist.isend(logits, 0), logits))
        output = ModelRunnerOutput(sampled_token_ids={})
        if self.is_driver:
            last = pp.global_rank(pp.size - 1) - pp.tp_rank  # the last stage's tensor-parallel rank 0
            for inputs in batches:
                vocab = self.arch.vocab_size
                for rows, is_lp in ((inputs.prompt_lp_indices, True), (inputs.sample_indices, False)):
                    if not rows:
                        continue
                    logits = torch.empty(len(rows), vocab, dtype=torch.float32, device=self.device)
                    dist.recv(logits, last)
                    if is_lp:
                        self._add_prompt_logprobs(logits, inputs, output)
                    else:
                        sample_logits.append(logits)
        for request, _ in sending:
            request.wait()
        self.step_collectives_done = True
        self.pipeline_step_s += time.perf_counter() - started
        if sample_logits:  # one sampling call for the whole step, as without a pipeline
            self._sample(torch.cat(sample_logits), [r for b in batches for r in b.sample_reqs], output)
        return output

    def _copy_host_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Run the step's host-tier copies: offloads first (before any block is overwritten), then restores."""
        if self.host_kv_cache is None:
            assert not scheduler_output.blocks_to_offload and not scheduler_output.blocks_to_restore
            return
        self.host_kv_cache.offload(self.kv_caches, scheduler_output.blocks_to_offload)
        self.host_kv_cache.restore(self.kv_caches, scheduler_output.blocks_to_restore)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks (every layer's K and V) from source to destination block ids, in
        order (a block freed by a later preemption of the step may be both a source and then a destination)."""
        bs = self.block_size
        for src, dst in copies:
            copy_kv_slots(self.kv_caches, [src * bs + o for o in range(bs)], [dst * bs + o for o in range(bs)])

    def _copy_branch_context(self, scheduled: list[ScheduledRequest]) -> None:
        """Tree candidates: copy the rows before each extra branch's root, in the block that holds the root,
        from the request's block into the branch's scratch block (earlier blocks are shared)."""
        bs = self.block_size
        src: list[int] = []
        dst: list[int] = []
        for req in scheduled:
            start = req.start_position
            first = start // bs
            for _, table in req.spec_branches:
                src.extend(req.block_table[first] * bs + o for o in range(start % bs))
                dst.extend(table[first] * bs + o for o in range(start % bs))
        copy_kv_slots(self.kv_caches, src, dst)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]) -> _StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        num_groups = len(self.kv_groups)
        slot_mappings: list[list[int]] = [[] for _ in range(num_groups)]  # each KV cache group's
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        lp_indices: list[int] = []
        lp_targets: list[int] = []
        lp_owners: list[tuple[str, int, int, int]] = []
        bs = self.block_size
        attn_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]  # per group: each row group's table
        # KV retention: (request_id, its row in the metadata, rows to score, how heads and layers combine)
        scored: list[tuple[str, int, int, str]] = []

        def add_tokens(ids: list[int], start: int, tables: list[list[int]], dropped: int = 0) -> int:
            """Append tokens at positions start.. with their slots in each group's table (whose first `dropped`
            positions' blocks were dropped by KV retention: a compacted table); returns the first's row."""
            first = len(input_ids)
            input_ids.extend(ids)
            positions.extend(range(start, start + len(ids)))
            for slot_mapping, table in zip(slot_mappings, tables, strict=True):
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start - dropped,
                                                                                 start - dropped + len(ids)))
            return first

        def add_rows(tables: list[list[int]]) -> None:
            for group_tables, table in zip(attn_tables, tables, strict=True):
                group_tables.append(table)

        def add_verify_rows(first: int, count: int, start: int, tables: list[list[int]]) -> None:
            """Rows first.. as decode rows of their own (row j sees positions <= start + j), all sampled."""
            for j in range(count):
                query_start_loc.append(first + j + 1)
                seq_lens.append(start + j + 1)
                add_rows(tables)
            sample_indices.extend(range(first, first + count))

        for req in scheduled:
            start = req.start_position
            n = len(req.token_ids)
            tables = req.group_block_tables or [req.block_table]
            dropped = req.num_dropped_tokens  # KV retention: its table lists the kept blocks only
            base = add_tokens(req.token_ids, start, tables, dropped)
            if req.kv_score_rows:
                # -1: KVScoreCollector samples the rows
                scored.append((req.request_id, len(seq_lens), req.kv_score_rows, req.kv_score_reduce))
            if req.spec_token_ids:
                # Verifying drafts: each query token is a decode row of its own, so the batched decode path,
                # and the one-call C step, compute it exactly as they would compute that token decoded alone.
                add_verify_rows(base, n, start, tables)
                sample_reqs.append(req)
                # tree candidates (one KV cache group only): each other branch, rows [last token] + its drafts in
                # its own blocks
                for tokens, branch_table in req.spec_branches:
                    ids = [req.token_ids[0], *tokens]
                    add_verify_rows(add_tokens(ids, start, [branch_table]), len(ids), start, [branch_table])
            elif req.decode_rows:
                for j in range(n):
                    query_start_loc.append(base + j + 1)
                    seq_lens.append(start + j + 1 - dropped)
                    add_rows(tables)
                if req.sample:
                    sample_indices.append(base + n - 1)
                    sample_reqs.append(req)
            else:
                query_start_loc.append(base + n)
                seq_lens.append(start + n - dropped)
                add_rows(tables)
                if req.sample:
                    sample_indices.append(base + n - 1)
                    sample_reqs.append(req)
            num_prompt = len(req.prompt_token_ids)
            if req.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                end = min(start + n, num_prompt - 1)  # the last prompt position predicts an output token
                first = len(lp_indices)
                lp_indices.extend(base + (p - start) for p in range(start, end))
                lp_targets.extend(req.prompt_token_ids[p + 1] for p in range(start, end))
                lp_owners.append((req.request_id, first, end - start, req.sampling_params.prompt_logprobs))
        dev = self.device
        query_start = torch.tensor(query_start_loc, dtype=torch.int32, device=dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        max_query_len = max(b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False))
        metas = []
        for slot_mapping, tables in zip(slot_mappings, attn_tables, strict=True):
            max_blocks = max(len(t) for t in tables)
            # zero-padded rows in one tensor construction (one torch call per step, not two per request)
            block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
                query_start_loc=query_start,
                seq_lens=seq_lens_t,
                block_tables=block_tables.to(dev),
                query_start_loc_cpu=query_start_loc,
                seq_lens_cpu=seq_lens,
                num_reqs=len(tables),
                max_query_len=max_query_len,
                block_size=bs,
                kv_scores=self._score_collector(scored),
            ))
        # one metadata serves every layer, or (a hybrid KV cache) each layer gets its group's
        attn_metadata = metas[0] if num_groups == 1 else [metas[g] for g in self.group_of_layer]
        return _StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attn_metadata=attn_metadata,
            sample_indices=sample_indices,
            sample_reqs=sample_reqs,
            prompt_lp_indices=lp_indices,
            prompt_lp_targets=lp_targets,
            prompt_lp_owners=lp_owners,
        )

    @staticmethod
    def _score_collector(scored: list[tuple[str, int, int, str]]) -> KVScoreCollector | None:
        """The step's collector of attention weights per KV block (KV retention), or None when nothing is scored."""
        if not scored:
            return None
        collector = KVScoreCollector()
        for request_id, req_index, rows, reduce in scored:
            collector.add(request_id, req_index, rows, reduce)
        return collector

    def _add_prompt_logprobs(self, logits: torch.Tensor, inputs: _StepInputs, output: ModelRunnerOutput) -> None:
        """logits [len(inputs.prompt_lp_indices), vocab_size] float32."""
        targets = torch.tensor(inputs.prompt_lp_targets, dtype=torch.int64, device=self.device)
        # Requests may ask for different top-N: compute once with the largest, then trim per request.
        num_top = max(owner[3] for owner in inputs.prompt_lp_owners)
        all_lps = compute_token_logprobs(logits, targets, num_top)
        for request_id, first, count, top in inputs.prompt_lp_owners:
            output.prompt_logprobs[request_id] = [_trim(lp, 1 + top) for lp in all_lps[first : first + count]]

    def _sample(self, logits: torch.Tensor, sample_reqs: list[ScheduledRequest], output: ModelRunnerOutput) -> None:
        """logits [sampled rows, vocab_size] float32 of `sample_reqs`' rows, in order."""
        sampling_inputs = []
        num_valid: dict[str, int] = {}  # structured-output request -> drafts its grammar accepts
        for r in sample_reqs:
            # a verify pass samples after the last token and after each draft of each branch, each row with
            # the output it would follow (penalties, min_tokens, a seeded request's uniform for that
            # position, and a structured-output request's grammar mask after the drafts before it)
            spec = r.sampling_params.structured_output
            masks = None
            if spec is not None:  # one branch: the scheduler gives structured-output requests no tree
                assert self.structured is not None and not r.spec_branches
                masks, num_valid[r.request_id] = self.structured.bitmasks(
                    r.request_id, spec, r.output_token_ids, r.spec_token_ids)
            for drafts in _branches(r):
                for j in range(len(drafts) + 1):
                    sampling_inputs.append(SamplingInput(
                        params=r.sampling_params,
                        prompt_token_ids=r.prompt_token_ids,
                        output_token_ids=r.output_token_ids + drafts[:j] if j else r.output_token_ids,
                        eos_token_ids=self.eos_token_ids,
                        token_bitmask=masks[j] if masks is not None else None,
                    ))
        result = sample(logits, sampling_inputs, self.default_generator)
        token_ids = result.sampled_token_ids.tolist()
        row = 0
        for req in sample_reqs:
            best: tuple[list[int], int, int] | None = None  # (kept tokens, first row, branch)
            for branch, drafts in enumerate(_branches(req)):
                n = len(drafts) + 1
                kept = accept_sampled(drafts, token_ids[row : row + n]) if n > 1 else token_ids[row : row + 1]
                if req.request_id in num_valid:  # never past a draft the grammar refused (its rows' masks
                    kept = kept[: num_valid[req.request_id] + 1]  # repeat the last valid state's)
                if best is None or len(kept) > len(best[0]):
                    best = (kept, row, branch)
                row += n
            assert best is not None
            kept, first, branch = best
            if branch > 0:
                self._keep_branch(req, branch, len(kept) - 1)
                output.spec_branch[req.request_id] = branch
            output.sampled_token_ids[req.request_id] = kept
            lps = result.logprobs[first : first + len(kept)]
            if lps[0] is not None:
                output.logprobs[req.request_id] = lps

    def _keep_branch(self, req: ScheduledRequest, branch: int, num_kept: int) -> None:
        """Move the K/V of an extra branch's kept drafts into the request's own blocks (the root's row is
        there already: branch 0 computed the same row)."""
        bs = self.block_size
        table = req.spec_branches[branch - 1][1]
        positions = range(req.start_position + 1, req.start_position + 1 + num_kept)
        copy_kv_slots(self.kv_caches, [table[p // bs] * bs + p % bs for p in positions],
                      [req.block_table[p // bs] * bs + p % bs for p in positions])
        stale_key_summaries(self.attn_backend, {req.block_table[p // bs] for p in positions})


def _branches(req: ScheduledRequest) -> list[list[int]]:
    """The draft runs a request verifies this step, branch 0 first."""
    return [req.spec_token_ids] + [tokens for tokens, _ in req.spec_branches]


def _trim(lp: TokenLogprobs, keep: int) -> TokenLogprobs:
    return TokenLogprobs(token_ids=lp.token_ids[:keep], logprobs=lp.logprobs[:keep], ranks=lp.ranks[:keep])
