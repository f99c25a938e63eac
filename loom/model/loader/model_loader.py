"""The public loading API: a checkpoint path (or None for the bundled model) -> a ready model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.attention.backend import AttentionBackend, default_attention_backend, get_attention_backend
from loom.attention.sparse import SparseAttentionConfig
from loom.config import check_model_path
from loom.distributed.pipeline_parallel import PipelineParallel
from loom.distributed.tensor_parallel import TensorParallel, check_tensor_parallel
from loom.model.arch import ModelArchConfig
from loom.model.loader.default import default_model_path
from loom.model.loader.gguf import (
    gguf_arch_config,
    gguf_eos_token_ids,
    gguf_has_tokenizer,
    gguf_tensor_types,
    iter_gguf_weights,
    open_gguf,
)
from loom.model.loader.hf_config import hf_arch_config, hf_eos_token_ids, read_json
from loom.model.loader.safetensors import iter_safetensors_weights, safetensors_tensor_names
from loom.model.loader.tokenizer import tokenizer_eos_ids, tokenizer_from_path
from loom.model.registry import get_model_class
from loom.quant.config import RTNConfig, get_quant_config
from loom.quant.awq_method import awq_quant_config, awq_quantization_config
from loom.quant.fp8_checkpoint import compressed_tensors_config, fp8_quant_config
from loom.quant.int8_checkpoint import int8_quant_config, iter_int8_weights
from loom.quant.gptq_method import read_gptq_checkpoint
from loom.quant.quantize import CONFIG_KEY


@dataclass(slots=True)
class LoadedModel:
    """A model ready for `forward`, with what the engine needs around it."""

    model: torch.nn.Module  # LlamaForCausalLM-like: forward(input_ids, positions, kv_caches, attn_metadata), compute_logits
    arch: ModelArchConfig  # shapes for the KV cache and the scheduler
    tokenizer: Any  # transformers tokenizer (with chat template when the checkpoint has one); None if the checkpoint has none
    eos_token_ids: frozenset[int]  # token ids that end generation
    model_path: str  # resolved checkpoint path (GGUF file or HF directory)
    attn_backend: AttentionBackend | None = None  # the one backend instance every attention layer runs


def resolve_model_path(model: str | None) -> Path:
    """The checkpoint path: `model`, or the bundled SmolLM2 GGUF when None.

    Raises:
        ValueError: the path does not exist, or is neither a file nor a directory with config.json.
    """
    if model is None:
        return default_model_path()
    return check_model_path(model)


def default_quantization(model: str | None) -> str:
    """The quantization a checkpoint runs with when none is asked for: "gguf" for a GGUF file (its own blocks),
    "gptq" / "awq" / "fp8" for a GPTQ / AWQ / compressed-tensors FP8 checkpoint (config.json's
    quantization_config), "w8a8" / "w8a16" for a compressed-tensors INT8 one with / without int8 activations,
    the method a `loom quantize`
    output was prepared for (loom/quant/quantize.py), else "none".

    Raises:
        ValueError: as resolve_model_path.
    """
    from loom.quant.quantize import prepared_method

    path = resolve_model_path(model)
    if path.is_file():
        return "gguf"
    config = read_json(path / "config.json")
    if gptq_quantization_config(config) is not None:
        return "gptq"
    if awq_quantization_config(config) is not None:
        return "awq"
    ct = compressed_tensors_config(config)
    if ct is not None and ct.get("format") == "int-quantized":  # int8: W8A8, or weights only
        groups = ct.get("config_groups") or {}
        group = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        return "w8a8" if isinstance(group, dict) and group.get("input_activations") else "w8a16"
    if ct is not None:
        return "fp8"
    return prepared_method(config) or "none"


def gptq_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config when it is a GPTQ one (quant_method "gptq"), else None."""
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "gptq" else None


def read_arch(model: str | None) -> ModelArchConfig:
    """Architecture of a checkpoint without loading its weights (cheap for HF dirs, a few s for GGUF).

    Raises:
        ValueError: as resolve_model_path, or an unsupported architecture.
    """
    path = resolve_model_path(model)
    if path.is_file():
        return gguf_arch_config(open_gguf(path))
    return hf_arch_config(read_json(path / "config.json"))


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of a checkpoint (None = bundled default model).

    Returns None for a Hugging Face directory without tokenizer files.

    Raises:
        ValueError: as resolve_model_path.
    """
    return tokenizer_from_path(resolve_model_path(model))


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    *,
    attention_backend: str | None = None,
    quantization: str | None = None,
    tp: TensorParallel | None = None,
    pp: PipelineParallel | None = None,
    sparse_attention: SparseAttentionConfig | None = None,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory into a loom model on `device` in `dtype`.

    GGUF tensors of the types loom repacks stay in their own bits by default (quantization "gguf"); others,
    and every tensor under quantization "none", are dequantized to float32, then cast to dtype. llama-arch
    Q/K rows are put back in the Hugging Face order (see loader.gguf.unpermute_rope_rows).

    Args:
        model: GGUF file path, HF model directory, or None for the bundled SmolLM2-135M-Instruct.
        dtype: a floating dtype for weights and activations (torch.float32, bfloat16, float16).
        device: where the parameters live.
        attention_backend: name in loom.attention.ATTENTION_BACKENDS; None = default_attention_backend(device).
        quantization: a name in loom.quant.config.QUANTIZATION_METHODS; None = default_quantization(model):
            "gguf" for a GGUF file (its own quantized blocks, repacked), "gptq" for a Hugging Face GPTQ
            checkpoint (its codes, repacked), the method a `loom quantize` output was prepared for, else "none".
        tp: this process's rank in a tensor-parallel group: it loads only its shard of each matrix
            (loom/distributed/tensor_parallel.py); None = the whole model.
        pp: this process's pipeline stage: it builds and loads its layers only (loom/distributed/pipeline_parallel.py).
        sparse_attention: block-sparse decode attention (loom/attention/sparse.py); None = dense.

    Raises:
        ValueError: unknown path, unsupported architecture or rope scaling, non-floating dtype,
            checkpoint tensors that do not match the architecture, unknown attention backend, unknown
            quantization or "gguf" for a non-GGUF checkpoint, sparse_attention on a model with sliding-window
            layers or soft-capped attention logits (or on an attention backend that cannot serve it).
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    path = resolve_model_path(model)
    weights: Iterator[tuple[str, torch.Tensor]]
    has_tokenizer = True
    if path.is_file():
        reader = open_gguf(path)
        arch = gguf_arch_config(reader)
        quant_config = get_quant_config(quantization, gguf_tensor_types(reader))
        weights = iter_gguf_weights(reader, arch, keep_packed=quant_config.keeps_gguf_packed)
        eos = gguf_eos_token_ids(reader)
        has_tokenizer = gguf_has_tokenizer(reader)
    else:
        config = read_json(path / "config.json")
        arch = hf_arch_config(config)
        gptq_qc, awq_qc = gptq_quantization_config(config), awq_quantization_config(config)
        fp8_qc = compressed_tensors_config(config)
        if (gptq_qc or awq_qc or fp8_qc) and (arch.num_experts or arch.architecture == "Phi3ForCausalLM"):
            # their checkpoints name projections our per-shard lookup does not know (w1/w3/w2, fused qkv_proj)
            raise ValueError(f"quantized (GPTQ / AWQ / compressed-tensors) checkpoints of {arch.architecture} are "
                             "not supported yet; load the unquantized checkpoint with --quantization w8a16|w4a16|fp8")
        gptq = None if gptq_qc is None else read_gptq_checkpoint(gptq_qc, safetensors_tensor_names(path))
        weights, eos = iter_safetensors_weights(path), hf_eos_token_ids(path, config)
        if awq_qc is not None:
            quant_config = awq_quant_config(quantization, awq_qc, safetensors_tensor_names(path))
        elif fp8_qc is not None and fp8_qc.get("format") == "int-quantized":
            quant_config = int8_quant_config(quantization, fp8_qc, safetensors_tensor_names(path))
            weights = iter_int8_weights(weights, quant_config.checkpoint)
        elif fp8_qc is not None:
            quant_config = fp8_quant_config(quantization, fp8_qc, safetensors_tensor_names(path))
        else:
            quant_config = get_quant_config(quantization or default_quantization(model), None, gptq)
            prepared = config.get(CONFIG_KEY)  # what `loom quantize` prepared
            if (isinstance(quant_config, RTNConfig) and isinstance(prepared, dict)
                    and prepared.get("weight_rounding") == "gptq" and prepared.get("method") == quant_config.name):
                quant_config.source_label = "GPTQ-rounded by loom quantize"
    model_cls = get_model_class(arch.architecture)
    if sparse_attention is not None:
        _check_sparse_attention(arch)
    backend = get_attention_backend(attention_backend or default_attention_backend(device),
                                    float32_kernels=quant_config.float32_kernels, sparse=sparse_attention)
    if tp is not None:
        check_tensor_parallel(arch, quant_config.name, tp.size)
    net = model_cls(arch, backend, dtype, device, quant_config, tp=tp, pp=pp)
    net.load_weights(weights)
    net.eval()
    tokenizer = tokenizer_from_path(path) if has_tokenizer else None
    eos |= tokenizer_eos_ids(tokenizer)
    return LoadedModel(net, arch, tokenizer, frozenset(eos), str(path), backend)


def _check_sparse_attention(arch: ModelArchConfig) -> None:
    """Refuse block-sparse decode attention where its selection would be wrong.

    Raises:
        ValueError: a sliding-window layer (the selection ignores the window) or attention-logit soft-capping
            (those layers bypass the backend, so their key summaries would not be kept).
    """
    if any(arch.layer_sliding_window(i) is not None for i in range(arch.num_layers)):
        raise ValueError(f"sparse_attention='topk-blocks' is not supported for {arch.architecture}: it has "
                         "sliding-window layers")
    if arch.attn_logit_softcapping is not None:
        raise ValueError(f"sparse_attention='topk-blocks' is not supported for {arch.architecture}: its attention "
                         "logits are soft-capped")
