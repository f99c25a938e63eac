"""Engine options on the command line: one place that maps argparse flags to EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from loom.config import (PREEMPTION_MODES, QUANTIZATION_METHODS, SPARSE_ATTENTION_METHODS, SUPPORTED_DTYPES,
                         SUPPORTED_KV_CACHE_DTYPES, EngineArgs)
from loom.core.kv_retention import KV_RETENTION_POLICIES
from loom.kv_transfer.base import KV_CONNECTORS, KV_TRANSFER_ROLES
from loom.spec.proposer import SPECULATIVE_METHODS


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, else an error naming both."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n

    return parse


def _optional_int(text: str) -> int | None:
    """An int flag that also takes 'none' (the option off)."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _defaults() -> argparse.Namespace:
    """EngineArgs' field defaults, read without constructing one (its validation, which reads the environment,
    belongs to the command's run, where its errors are reported, not to building the parser)."""
    return argparse.Namespace(**{f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                                 for f in dataclasses.fields(EngineArgs)})


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every EngineArgs option to `parser` (used by generate, chat, serve and bench)."""
    defaults = _defaults()
    g = parser.add_argument_group("engine options")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: the bundled SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--dtype", default=defaults.dtype, choices=SUPPORTED_DTYPES,
                   help="weights and activations dtype (default: %(default)s: float32 with packed weights on a CPU, "
                        "else bfloat16 where the device multiplies it natively, else float32)")
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weight quantization: gguf = a GGUF file's own quantized blocks (the default for GGUF); "
                        "none = dequantize to --dtype at load (exact transformers parity in float32); w8a16, "
                        "w4a16, w8a8, fp8 = quantize at load (docs/quantization.md)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per request, prompt + output (default: the model's context length)")
    g.add_argument("--seed", type=int, default=defaults.seed,
                   help="seed of the engine generator used by requests without their own seed (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=defaults.block_size,
                   help="tokens per KV cache block (default: %(default)s)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=defaults.kv_cache_memory_gb,
                   help="memory budget of the paged KV cache in GiB (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks; overrides --kv-cache-memory-gb")
    g.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=SUPPORTED_KV_CACHE_DTYPES,
                   help="KV cache storage; auto = --dtype, except float16 for packed weights on the CPU (the GGUF "
                        "default: llama.cpp's KV type, half the bytes of float32); int8: codes with a float16 scale "
                        "and minimum per 32 values; fp8_e4m3: a float32 scale per token and KV head (default: "
                        "%(default)s)")
    g.add_argument("--kv-offload-memory", dest="kv_offload_memory_gb", type=float, metavar="GIB",
                   default=defaults.kv_offload_memory_gb,
                   help="GiB of host memory for KV blocks evicted from the prefix cache or swapped out by "
                        "preemption; 0 = no host tier (default: %(default)s)")
    g.add_argument("--preemption-mode", default=defaults.preemption_mode, choices=PREEMPTION_MODES,
                   help="recompute: a preempted request recomputes its KV; swap: its blocks go to the host tier "
                        "(needs --kv-offload-memory) and are copied back (default: %(default)s)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    g.add_argument("--no-hybrid-kv-cache", dest="hybrid_kv_cache", action="store_false",
                   help="models that mix sliding-window and global layers (Gemma 2 / 3): keep one block table for "
                        "every layer instead of one per layer group (the sliding layers then hold every block)")
    g.add_argument("--kv-retention", default=defaults.kv_retention, choices=KV_RETENTION_POLICIES,
                   help="long prompts under a KV budget (docs/long_context.md): full = keep every block; sinks = "
                        "StreamingLLM's first tokens + recent window; h2o = heavy hitters by accumulated attention; "
                        "snapkv = blocks chosen by the prompt's last queries; the prompt is prefilled exactly, then "
                        "cut to --kv-retention-budget (default: %(default)s)")
    g.add_argument("--kv-retention-budget", type=float, default=defaults.kv_retention_budget,
                   help="KV kept per request under a lossy --kv-retention: <= 1 = a fraction of the prompt's "
                        "tokens, > 1 = tokens, in whole blocks; never less than the sink block and the recent "
                        "window, which every policy keeps (default: %(default)s)")
    g.add_argument("--kv-retention-sink-tokens", type=int, default=defaults.kv_retention_sink_tokens,
                   help="first tokens always kept by sinks and h2o, rounded up to whole blocks (default: %(default)s)")
    g.add_argument("--kv-retention-window", type=int, default=defaults.kv_retention_window,
                   help="recent tokens always kept, and snapkv's observation window (default: %(default)s)")
    g.add_argument("--sparse-attention", default=defaults.sparse_attention, choices=SPARSE_ATTENTION_METHODS,
                   help="block-sparse decode attention: topk-blocks = each decode query reads only the blocks whose "
                        "key bounds score highest (Quest), plus sink and recent blocks (default: %(default)s)")
    g.add_argument("--sparse-attention-topk", type=int, default=defaults.sparse_attention_topk,
                   help="topk-blocks: blocks read per decode query besides the sink and recent ones "
                        "(default: %(default)s)")
    g.add_argument("--sparse-attention-sink-blocks", type=int, default=defaults.sparse_attention_sink_blocks,
                   help="topk-blocks: first blocks always read (default: %(default)s)")
    g.add_argument("--sparse-attention-recent-blocks", type=int, default=defaults.sparse_attention_recent_blocks,
                   help="topk-blocks: last blocks always read, the partial one included (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                   help="token budget of one engine step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="bound on the waiting queue; when full, new requests are refused (HTTP 503)")
    g.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding, verified exactly by the model (docs/speculative.md): ngram = "
                        "prompt lookup (drafts copied from earlier in the prompt and output); suffix = "
                        "SuffixDecoding (suffix trees over the request and earlier outputs); draft_model = a "
                        "smaller model with the same tokenizer (--speculative-model); default: off")
    g.add_argument("--speculative-model", default=None,
                   help="draft_model (implied when --speculative-method is not given): the draft's GGUF file or "
                        "Hugging Face directory; it runs at the target's "
                        "--dtype and --quantization with a KV cache of its own of --kv-cache-memory-gb")
    g.add_argument("--speculative-quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="draft_model: the draft's weight quantization (default: the target's --quantization); "
                        "a coarser draft reads fewer bytes per draft token and can only cost acceptance")
    g.add_argument("--speculative-draft-vocab-size", type=int, default=None,
                   help="draft_model: the draft's LM head computes the logits of only this many most frequent tokens "
                        "(FR-Spec; frequencies from --speculative-draft-vocab-corpus) plus the special tokens: a "
                        "cheaper draft token, at some acceptance; the target still verifies over its whole "
                        "vocabulary (default: the whole vocabulary)")
    g.add_argument("--speculative-draft-vocab-corpus", default=None,
                   help="draft_model with --speculative-draft-vocab-size: a text file, or a directory of .py/.txt/.md/"
                        ".rst/.json/.jsonl files, whose token frequencies rank the vocabulary (default: the Python "
                        "standard library's source)")
    g.add_argument("--num-speculative-tokens", type=int, default=defaults.num_speculative_tokens,
                   help="most draft tokens per request and step (default: %(default)s)")
    g.add_argument("--speculative-tree-width", type=int, default=defaults.speculative_tree_width,
                   help="ngram, suffix: tree candidates, the most draft branches (different first drafts) "
                        "verified per greedy request and step; each extra branch costs its own verify rows "
                        "(default: %(default)s = one chain)")
    g.add_argument("--prompt-lookup-min", type=int, default=defaults.prompt_lookup_min,
                   help="ngram: shortest suffix that may match, in tokens (default: %(default)s)")
    g.add_argument("--prompt-lookup-max", type=int, default=defaults.prompt_lookup_max,
                   help="ngram: longest suffix, tried first, in tokens (default: %(default)s)")
    g.add_argument("--suffix-decoding-max-tree-depth", type=int, default=defaults.suffix_decoding_max_tree_depth,
                   help="suffix: longest substring the suffix trees count, match plus drafts, in tokens "
                        "(default: %(default)s)")
    g.add_argument("--suffix-decoding-max-cached-requests", type=int,
                   default=defaults.suffix_decoding_max_cached_requests,
                   help="suffix: finished requests whose outputs the global tree holds; 0 = per-request trees "
                        "only (default: %(default)s)")
    g.add_argument("--suffix-decoding-max-spec-factor", type=float, default=defaults.suffix_decoding_max_spec_factor,
                   help="suffix: at most factor x match length (+ offset) drafts (default: %(default)s)")
    g.add_argument("--suffix-decoding-max-spec-offset", type=float, default=defaults.suffix_decoding_max_spec_offset,
                   help="suffix: see --suffix-decoding-max-spec-factor (default: %(default)s)")
    g.add_argument("--suffix-decoding-min-token-prob", type=float, default=defaults.suffix_decoding_min_token_prob,
                   help="suffix: stop drafting once the run's estimated probability falls below this "
                        "(default: %(default)s)")
    g.add_argument("--speculative-disable-by-batch-size", type=_optional_int,
                   default=defaults.speculative_disable_by_batch_size,
                   help="no drafts in a step while at least this many requests run, where verify rows cost "
                        "about as much as decode rows; 'none' = never off (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS if set, else the number of cores; with tensor "
                        "parallelism, per rank: the cores shared by the local ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=defaults.tensor_parallel_size,
                   help="processes that split every weight matrix (Megatron-style tensor parallelism on "
                        "torch.distributed, gloo): N - 1 local workers are started, or the ranks of a torchrun "
                        "launch join (docs/distributed.md) (default: %(default)s)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=defaults.pipeline_parallel_size,
                   help="stages the decoder layers are split into (GPipe-style pipeline parallelism), each of "
                        "--tensor-parallel-size ranks (default: %(default)s)")
    g.add_argument("--pipeline-microbatches", type=int, default=defaults.pipeline_microbatches,
                   help="pipeline parallel: most micro-batches a step's requests are cut into, so that the stages "
                        "work at once (default: %(default)s)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: spread whole experts over the --tensor-parallel-size ranks and "
                        "send each token to its experts' ranks and back (all-to-all), instead of splitting every "
                        "expert's width")
    g.add_argument("--context-parallel-size", "-cp", type=int, default=defaults.context_parallel_size,
                   help="processes that split a long prompt's prefill by position (context parallelism: ring "
                        "attention over the ranks' K/V chunks); each holds the whole model and KV cache, and decode "
                        "steps run on every rank alike (docs/distributed.md) (default: %(default)s)")
    g.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float,
                   default=defaults.distributed_timeout_s,
                   help="model parallelism: seconds a collective may wait for a rank before the engine "
                        "fails (a stuck worker) (default: %(default)s)")
    return parser


def add_kv_transfer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Prefill/decode disaggregation flags (`loom serve`; docs/disaggregation.md)."""
    defaults = _defaults()
    g = parser.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--kv-transfer-role", default=None, choices=KV_TRANSFER_ROLES,
                   help="producer: prefill requests sent with kv_transfer_params {do_remote_decode: true} and serve "
                        "their KV blocks; consumer: pull them for requests sent with {do_remote_prefill: true, ...}; "
                        "both (default: off)")
    g.add_argument("--kv-connector", default=defaults.kv_connector, choices=sorted(KV_CONNECTORS),
                   help="how KV blocks travel (default: %(default)s)")
    g.add_argument("--kv-transfer-host", default=defaults.kv_transfer_host,
                   help="producer: address its KV server listens on and advertises (default: %(default)s)")
    g.add_argument("--kv-transfer-port", type=int, default=defaults.kv_transfer_port,
                   help="producer: KV server port; 0 = any free port (default: %(default)s)")
    g.add_argument("--kv-transfer-timeout", dest="kv_transfer_timeout_s", type=float,
                   default=defaults.kv_transfer_timeout_s,
                   help="producer: seconds a prefilled request's blocks stay pinned unread (default: %(default)s)")
    g.add_argument("--kv-transfer-peers", nargs="+", type=str, default=list(defaults.kv_transfer_peers),
                   metavar="HOST", help="consumer: the prefill replicas' hosts it may pull K/V from, '*' for any "
                   "(default: %(default)s; a request names the host, so keep this to your own replicas)")
    g.add_argument("--kv-transfer-pull-timeout", dest="kv_transfer_pull_timeout_s", type=float,
                   default=defaults.kv_transfer_pull_timeout_s,
                   help="consumer: seconds a pull may take before the prompt is computed locally "
                        "(default: %(default)s)")
    return parser


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Build EngineArgs from parsed flags. Raises ValueError naming a bad option."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
