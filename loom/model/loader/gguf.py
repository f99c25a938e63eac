"""GGUF checkpoints (llama.cpp format) read with the `gguf` library.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Tensor names are mapped to
Hugging Face names; quantized tensors are dequantized to float32 by `gguf.quants.dequantize`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from loom.model.arch import ModelArchConfig, gemma_fields, gemma_layer_types

# general.architecture -> our architecture name (a "llama" file with experts is Mixtral: llama.cpp has no arch of
# its own for it)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                      "olmoe": "OlmoeForCausalLM"}
# QK-norm over the whole q / k projections (one weight of num_heads * head_dim) rather than per head
_QK_NORM_PROJECTION = {"olmo2", "olmoe"}
# whether the router's top-k probabilities are renormalized, as llama.cpp's graph for each family fixes it
# (src/llama-model.cpp, build_moe_ffn's norm_w); a file's {arch}.expert_weights_norm overrides it
_MOE_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# Gemma's sliding/global layer pattern, fixed by llama.cpp per architecture (src/llama-model.cpp, set_swa_pattern):
# every n-th layer is global; the 27B models scale the softmax by (hidden / heads) ** -0.5 instead of head_dim's
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# GGUF per-layer tensor stem -> Hugging Face module path under model.layers.{i}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # QK-norm (qwen3)
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# mixture-of-experts FFNs: the router, and Qwen2-MoE's shared expert with its sigmoid gate
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# the experts' projections, stacked by llama.cpp's converter into one 3-D tensor [experts, rows, columns] each
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# the norms after attention and after the MLP (OLMo 2's only norms; Gemma's sandwich)
_POST_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, **_POST_NORM_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
# Phi-3's fused projections: attn_qkv holds q, k, v and ffn_up holds gate then up, split at load into our shards
_FUSED_NAMES = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}
# router weights stay dense (their logits decide the routing; llama.cpp does not quantize them either)
_DENSE_ONLY = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file.

    Raises:
        ValueError: the file is not a GGUF file (no "GGUF" magic), has a GGUF version other than 2 or 3, or is
            truncated or damaged; the message names the file.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ValueError(f"model {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    if head[:4] != b"GGUF":  # the gguf library's own message for this is numpy's, about array sizes
        raise ValueError(f"model {str(path)!r} is not a GGUF file: it does not start with the magic bytes 'GGUF' "
                         f"(found {head[:4]!r})")
    if len(head) < 8:
        raise ValueError(f"model {str(path)!r} is a truncated GGUF file")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise ValueError(f"model {str(path)!r} is a GGUF file of version {version}, which cannot be read (versions 2 "
                         "and 3 can)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - past the magic and version, any failure of the reader is a damaged file
        raise ValueError(f"model {str(path)!r} is not a readable GGUF file (truncated or damaged: {exc})") from exc


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Value of a metadata key (scalar, string or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch_config(reader: gguf.GGUFReader) -> ModelArchConfig:
    """Architecture of a GGUF model from its `{arch}.*` metadata and, where the metadata is silent, its tensors'
    names and shapes (which layers route to experts, the experts' width).

    Raises:
        ValueError: general.architecture is not supported, rotary on part of each head, or a rope scaling type
            is unknown.
    """
    gguf_arch = gguf_field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{gguf_arch}.{key}", default)

    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # Hugging Face order
    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    vocab = meta("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    num_layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rotary_dims = meta("rope.dimension_count")
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        raise ValueError(f"{gguf_arch}.rope.dimension_count {rotary_dims} != head_dim {head_dim} (rotary on part of "
                         "each head) is not supported")
    moe = _gguf_moe_fields(gguf_arch, meta, shapes, num_layers)
    gemma: dict[str, Any] = {}
    if gguf_arch in _GEMMA_SWA_PATTERN:
        pattern = _GEMMA_SWA_PATTERN[gguf_arch]
        softcaps = {key: meta(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        gemma = dict(
            sliding_window=int(meta("attention.sliding_window")),
            **gemma_fields(hidden_size, hidden_size // num_heads if num_layers == _GEMMA_27B_LAYERS[gguf_arch]
                           else head_dim, gemma_layer_types(num_layers, pattern),
                           10000.0 if gguf_arch == "gemma3" else None,  # llama.cpp's fixed local base
                           softcaps["attn_logit_softcapping"], softcaps["final_logit_softcapping"]),
        )
    window = meta("attention.sliding_window") if gguf_arch == "phi3" else None  # 0: none (Phi-4)
    feed_forward = meta("feed_forward_length")  # absent in some MoE files: every layer routes
    return ModelArchConfig(
        architecture="MixtralForCausalLM" if gguf_arch == "llama" and moe else GGUF_ARCHITECTURES[gguf_arch],
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(feed_forward if feed_forward is not None else moe["moe_intermediate_size"]),
        vocab_size=int(vocab),
        max_position_embeddings=int(meta("context_length", 2048)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes or "blk.0.attn_qkv.bias" in shapes,
        qk_norm=None if "blk.0.attn_q_norm.weight" not in shapes
        else "projection" if gguf_arch in _QK_NORM_PROJECTION else "per_head",
        post_norm=gguf_arch == "olmo2",
        **{"sliding_window": int(window) if window else None} | gemma,
        **moe,
    )


def _gguf_moe_fields(gguf_arch: str, meta: Any, shapes: dict[str, tuple[int, ...]],
                     num_layers: int) -> dict[str, Any]:
    """ModelArchConfig's mixture-of-experts fields of a GGUF file ({} for a dense one): expert counts from the
    metadata, widths from the expert tensors' shapes, the dense layers as those without a router tensor."""
    experts = int(meta("expert_count", 0) or 0)
    if not experts:
        return {}
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if not sparse:
        raise ValueError(f"{gguf_arch}.expert_count is {experts} but no layer has a router (ffn_gate_inp) tensor")
    first = sparse[0]
    if f"blk.{first}.ffn_up_exps.weight" not in shapes:
        raise ValueError("GGUF experts stored one tensor per expert (blk.N.ffn_up.E, before llama.cpp's 3-D "
                         "ffn_up_exps) are not supported; convert the model again with a current llama.cpp")
    norm = meta("expert_weights_norm")
    shared = shapes.get(f"blk.{first}.ffn_up_shexp.weight")
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=shapes[f"blk.{first}.ffn_up_exps.weight"][1],
        moe_renormalize=_MOE_RENORMALIZE[gguf_arch] if norm is None else bool(norm),
        shared_expert_intermediate_size=0 if shared is None else shared[0],
        dense_mlp_layers=tuple(i for i in range(num_layers) if i not in sparse),
    )


def _gguf_rope_scaling(reader: gguf.GGUFReader, gguf_arch: str) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{gguf_arch}.rope.scaling.type", "none")
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}

    def table(name: str) -> tuple[float, ...]:
        tensor = tensors[name]
        return tuple(float(f) for f in gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1))

    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama-3 style scaling as per-frequency divisors instead of metadata.
        return {"rope_type": "freq_factors", "freq_factors": table("rope_freqs.weight")}
    if "rope_factors_long.weight" in tensors:
        # Phi-3's LongRoPE: the two factor tables as tensors, the cos/sin scale precomputed by the converter
        original = gguf_field(reader, f"{gguf_arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError("LongRoPE factors without rope.scaling.original_context_length")
        attn_factor = gguf_field(reader, f"{gguf_arch}.rope.scaling.attn_factor")
        return {"rope_type": "longrope", "long_factor": table("rope_factors_long.weight"),
                "short_factor": table("rope_factors_short.weight"), "original_max_position_embeddings": int(original),
                **({} if attn_factor is None else {"attention_factor": float(attn_factor)})}
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported; supported: ['linear']")
    return {"rope_type": "linear", "factor": float(gguf_field(reader, f"{gguf_arch}.rope.scaling.factor"))}


def gguf_eos_token_ids(reader: gguf.GGUFReader) -> set[int]:
    """End-of-generation ids from tokenizer metadata: eos, and end-of-turn / end-of-message if present."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(v) for v in (gguf_field(reader, k) for k in keys) if v is not None}


def gguf_has_tokenizer(reader: gguf.GGUFReader) -> bool:
    """Whether the file carries a tokenizer (tokenizer.ggml.* metadata)."""
    return "tokenizer.ggml.tokens" in reader.fields


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter reordering of Q/K projection rows for llama-arch models.

    The converter interleaves each head's two rotary halves (rows i and i + d/2 become rows 2i and
    2i + 1) for its pairwise rope; HF's rotate-half rope needs the original order back.
    weight: [num_heads * head_dim, ...] (a weight or a bias). Returns the same shape.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensor_names(name: str, gguf_arch: str | None = None, num_experts: int = 0) -> list[str]:
    """Hugging Face names of the tensors a GGUF tensor holds, in the order it stores them: one name for most, one
    per expert for a stacked expert tensor (`num_experts` of them), q/k/v or gate/up for Phi-3's fused
    projections; [] for a tensor the model does not use. gguf_arch (the file's general.architecture) picks the
    family's names of its norms."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return [f"{_GLOBAL_NAMES[stem]}.{suffix}"]
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return []
    layer, kind = f"model.layers.{parts[1]}", parts[2]
    if gguf_arch == "phi3" and kind in _FUSED_NAMES:
        return [f"{layer}.{module}.{suffix}" for module in _FUSED_NAMES[kind]]
    if kind in _EXPERT_NAMES:
        return [f"{layer}.mlp.experts.{e}.{_EXPERT_NAMES[kind]}.{suffix}" for e in range(num_experts)]
    names = (_GEMMA_LAYER_NAMES if gguf_arch in _GEMMA_SWA_PATTERN
             else {**_LAYER_NAMES, **_POST_NORM_NAMES} if gguf_arch == "olmo2" else _LAYER_NAMES)
    module = names.get(kind) or _MOE_NAMES.get(kind)
    return [] if module is None else [f"{layer}.{module}.{suffix}"]


def gguf_tensor_name(name: str, gguf_arch: str | None = None) -> str | None:
    """Hugging Face name of a GGUF tensor that holds one model tensor, or None for tensors the model does not use
    (see gguf_tensor_names for the fused and stacked ones)."""
    names = gguf_tensor_names(name, gguf_arch)
    return names[0] if len(names) == 1 else None


def gguf_tensor_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """Hugging Face weight name -> GGML type name ("Q4_1", "Q8_0", "F32", ...) of every model tensor (each
    expert's and each fused part's own name: they share the type of the tensor that holds them)."""
    types = {}
    gguf_arch = gguf_field(reader, "general.architecture")
    experts = int(gguf_field(reader, f"{gguf_arch}.expert_count", 0) or 0)
    for tensor in reader.tensors:
        for hf_name in gguf_tensor_names(tensor.name, gguf_arch, experts):
            types[hf_name] = tensor.tensor_type.name
    return types


def _split(data: np.ndarray, shape: tuple[int, ...], names: list[str],
           arch: ModelArchConfig) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
    """(name, raw data, Hugging Face shape) of each tensor a GGUF tensor holds. The raw data of every GGML type
    is indexed [..., rows, bytes or values of a row], so experts split on the first axis and fused projections on
    rows, without dequantizing."""
    if len(names) == 1:
        return [(names[0], data, shape)]
    if len(shape) == 3:  # stacked experts [experts, rows, columns]
        return [(name, data[e], shape[1:]) for e, name in enumerate(names)]
    if len(names) == 3:  # Phi-3's attn_qkv
        sizes = [arch.q_size, arch.kv_size, arch.kv_size]
    else:  # Phi-3's ffn_up: gate then up
        sizes = [shape[0] // 2, shape[0] // 2]
    if sum(sizes) != shape[0]:
        raise ValueError(f"GGUF tensor of {shape[0]} rows does not split into {names} of {sizes} rows")
    bounds = np.cumsum([0, *sizes])
    return [(name, data[bounds[i]:bounds[i + 1]], (sizes[i], *shape[1:])) for i, name in enumerate(names)]


def iter_gguf_weights(
    reader: gguf.GGUFReader, arch: ModelArchConfig, keep_packed: bool = False
) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, tensor in HF layout) for every model tensor of the file: float32 tensors,
    or with `keep_packed` a loom PackedWeight (loom/quant/layout.py) for each 2-D tensor of a type that
    loom repacks exactly (loom/quant/gguf_repack.py), so the model runs from the file's own blocks. Stacked
    expert tensors come out one per expert and Phi-3's fused projections as their parts, still packed; the
    routers stay dense.

    Raises:
        ValueError: a tensor name the mapping does not know (other than the rope tables), or a fused tensor
            whose rows do not split into its parts.
    """
    from loom.quant.gguf_repack import REPACKED_TYPES, repack_gguf, unpermute_packed_rows

    gguf_arch = gguf_field(reader, "general.architecture")
    permuted = gguf_arch == "llama"
    for tensor in reader.tensors:
        if tensor.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            continue  # folded into arch.rope_scaling
        names = gguf_tensor_names(tensor.name, gguf_arch, arch.num_experts)
        if not names:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no known parameter")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        for hf_name, data, part_shape in _split(tensor.data, shape, names, arch):
            if (keep_packed and len(part_shape) == 2 and tensor.tensor_type in REPACKED_TYPES
                    and not hf_name.endswith(_DENSE_ONLY)):
                packed = repack_gguf(data, tensor.tensor_type, part_shape)
                if permuted and ".self_attn.q_proj." in hf_name:
                    packed = unpermute_packed_rows(packed, arch.num_heads)
                elif permuted and ".self_attn.k_proj." in hf_name:
                    packed = unpermute_packed_rows(packed, arch.num_kv_heads)
                yield hf_name, packed
                continue
            array = np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
            if not array.flags.writeable or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array).copy()  # unquantized tensors are read-only views of the mmap
            weight = torch.from_numpy(array).reshape(part_shape)
            if hf_name.endswith("shared_expert_gate.weight"):
                weight = weight.reshape(1, -1)  # llama.cpp stores Qwen2-MoE's [1, hidden] gate as [hidden]
            if arch.norm_weight_offset and hf_name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's norm weights with the 1 added; Hugging Face's layout (and
                # transformers' GGUF reader) has w alone
                weight = weight - arch.norm_weight_offset
            if permuted and ".self_attn.q_proj." in hf_name:
                weight = unpermute_rope_rows(weight, arch.num_heads)
            elif permuted and ".self_attn.k_proj." in hf_name:
                weight = unpermute_rope_rows(weight, arch.num_kv_heads)
            yield hf_name, weight
