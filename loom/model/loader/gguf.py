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

# general.architecture -> our architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
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
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, and two more follow attention and the MLP
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file.

    Raises:
        ValueError: the file is not a readable GGUF file.
    """
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"model {str(path)!r} is not a readable GGUF file: {exc}") from exc


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Value of a metadata key (scalar, string or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch_config(reader: gguf.GGUFReader) -> ModelArchConfig:
    """Architecture of a GGUF model from its `{arch}.*` metadata.

    Raises:
        ValueError: general.architecture is not supported, or a rope scaling type is unknown.
    """
    gguf_arch = gguf_field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{gguf_arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    vocab = meta("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    num_layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
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
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(meta("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(meta("context_length", 2048)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="per_head" if "blk.0.attn_q_norm.weight" in tensor_names else None,
        **({"sliding_window": None} | gemma),
    )


def _gguf_rope_scaling(reader: gguf.GGUFReader, gguf_arch: str) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{gguf_arch}.rope.scaling.type", "none")
    freq_factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freq_factors is not None:
        # llama.cpp stores Llama-3 style scaling as per-frequency divisors instead of metadata.
        factors = gguf.quants.dequantize(freq_factors.data, freq_factors.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": tuple(float(f) for f in factors)}
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


def gguf_tensor_name(name: str, gguf_arch: str | None = None) -> str | None:
    """Hugging Face name of a GGUF tensor name, or None for tensors the model does not use. gguf_arch (the file's
    general.architecture) picks Gemma's names of its sandwich norms."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    names = _GEMMA_LAYER_NAMES if gguf_arch in _GEMMA_SWA_PATTERN else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return None


def gguf_tensor_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """Hugging Face weight name -> GGML type name ("Q4_1", "Q8_0", "F32", ...) of every model tensor."""
    types = {}
    gguf_arch = gguf_field(reader, "general.architecture")
    for tensor in reader.tensors:
        hf_name = gguf_tensor_name(tensor.name, gguf_arch)
        if hf_name is not None:
            types[hf_name] = tensor.tensor_type.name
    return types


def iter_gguf_weights(
    reader: gguf.GGUFReader, arch: ModelArchConfig, keep_packed: bool = False
) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, tensor in HF layout) for every model tensor of the file: float32 tensors,
    or with `keep_packed` a loom PackedWeight (loom/quant/layout.py) for each 2-D tensor of a type that
    loom repacks exactly (loom/quant/gguf_repack.py), so the model runs from the file's own blocks.

    Raises:
        ValueError: a tensor name the mapping does not know (other than rope_freqs).
    """
    from loom.quant.gguf_repack import REPACKED_TYPES, repack_gguf, unpermute_packed_rows

    gguf_arch = gguf_field(reader, "general.architecture")
    permuted = gguf_arch == "llama"
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into arch.rope_scaling
        hf_name = gguf_tensor_name(tensor.name, gguf_arch)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no known parameter")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        if keep_packed and len(shape) == 2 and tensor.tensor_type in REPACKED_TYPES:
            packed = repack_gguf(tensor.data, tensor.tensor_type, shape)
            if permuted and ".self_attn.q_proj." in hf_name:
                packed = unpermute_packed_rows(packed, arch.num_heads)
            elif permuted and ".self_attn.k_proj." in hf_name:
                packed = unpermute_packed_rows(packed, arch.num_kv_heads)
            yield hf_name, packed
            continue
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not array.flags.writeable:
            array = array.copy()  # unquantized tensors come back as read-only views of the mmap
        weight = torch.from_numpy(array).reshape(shape)
        if arch.norm_weight_offset and hf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights with the 1 added; Hugging Face's layout (and
            # transformers' GGUF reader) has w alone
            weight = weight - arch.norm_weight_offset
        if permuted and ".self_attn.q_proj." in hf_name:
            weight = unpermute_rope_rows(weight, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in hf_name:
            weight = unpermute_rope_rows(weight, arch.num_kv_heads)
        yield hf_name, weight
