"""Hugging Face model directories: config.json and generation_config.json -> ModelArchConfig, EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.model.arch import ModelArchConfig, gemma_fields, gemma_layer_types

# config.json model_type -> architecture, for configs saved without an `architectures` list
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "olmoe": "OlmoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the mixture-of-experts families: how each names its expert count (transformers 5 writes num_local_experts for all)
_MOE = {"MixtralForCausalLM": "num_local_experts", "Qwen2MoeForCausalLM": "num_experts",
        "Qwen3MoeForCausalLM": "num_experts", "OlmoeForCausalLM": "num_experts"}


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file.

    Raises:
        ValueError: the file is missing or not a JSON object.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model directory lacks {path.name}: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def hf_architecture(config: dict[str, Any]) -> str:
    """First entry of `architectures`, else the one implied by `model_type`, else ValueError."""
    archs = config.get("architectures") or []
    if archs:
        return str(archs[0])
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"config.json names no architectures and an unknown model_type {model_type!r}")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None). transformers 5 nests both under `rope_parameters` (per layer type for
    Gemma 3: the global layers' entry is the model's rope; the sliding layers' is `_local_rope_theta`'s)."""
    params = dict(config.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} (rotary on part of each head) is not supported")
    scaling = params or config.get("rope_scaling") or None
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type == "su":  # LongRoPE's first name in Phi-3 configs
            rope_type = "longrope"
        scaling["rope_type"] = rope_type
        if rope_type == "longrope" and "original_max_position_embeddings" not in scaling:
            if config.get("original_max_position_embeddings") is None:
                raise ValueError("longrope rope scaling needs original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(config["original_max_position_embeddings"])
    return theta, scaling


def _local_rope_theta(architecture: str, config: dict[str, Any]) -> float | None:
    """Gemma 3's rotary base of the sliding layers (unscaled default rope), None for every other family.

    Raises:
        ValueError: the sliding layers' rope is scaled (not supported).
    """
    if architecture != "Gemma3ForCausalLM":
        return None
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:  # transformers 4 configs
        return float(config.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"sliding-layer rope type {local.get('rope_type')!r} is not supported (only 'default')")
    return float(local.get("rope_theta", 10000.0))


def _gemma_fields(architecture: str, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelArchConfig's Gemma fields of a config.json ({} for other families): the layer pattern (layer_types,
    or every `sliding_window_pattern`-th layer global in older configs), (1 + w) norms, GeGLU, the embedding and
    softmax scales, soft-capping."""
    if architecture not in _GEMMA:
        return {}
    types = config.get("layer_types")
    if types is None:  # transformers 4: Gemma 2 alternates (even layers slide), Gemma 3 every 6th layer is global
        pattern = int(config.get("sliding_window_pattern") or (2 if architecture == "Gemma2ForCausalLM" else 6))
        types = gemma_layer_types(num_layers, pattern)
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{architecture} with hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return gemma_fields(int(config["hidden_size"]), config.get("query_pre_attn_scalar") or head_dim, tuple(types),
                        _local_rope_theta(architecture, config), config.get("attn_logit_softcapping"),
                        config.get("final_logit_softcapping"))


def _sliding_window(architecture: str, config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if config.get("use_sliding_window"):
            raise ValueError(f"{architecture} with use_sliding_window=true (per-layer windows) is not supported")
        return None
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", *_GEMMA) and window is not None:
        return int(window)
    return None


def hf_arch_config(config: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a parsed config.json (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2/3-MoE, OLMo 2, OLMoE,
    Phi-3, Gemma 2, Gemma 3 fields).

    Raises:
        ValueError: a required key is missing, or an unsupported sliding-window layout.
    """
    architecture = hf_architecture(config)
    try:
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        theta, scaling = _rope(config)
        return ModelArchConfig(
            architecture=architecture,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False))
            or (architecture == "Qwen2MoeForCausalLM" and bool(config.get("qkv_bias", True))),
            sliding_window=_sliding_window(architecture, config),
            qk_norm={"Qwen3ForCausalLM": "per_head", "Qwen3MoeForCausalLM": "per_head", "Olmo2ForCausalLM": "projection",
                     "OlmoeForCausalLM": "projection", "Gemma3ForCausalLM": "per_head"}.get(architecture),
            post_norm=architecture == "Olmo2ForCausalLM",
            **_moe_fields(architecture, config),
            **_gemma_fields(architecture, config, int(config["num_hidden_layers"])),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks the key {exc.args[0]!r}") from None


def _moe_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """ModelArchConfig's mixture-of-experts fields of a config.json ({} for a dense family).

    Raises:
        ValueError: OLMoE's clip_qkv (not supported).
    """
    if architecture not in _MOE:
        return {}
    if config.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {config['clip_qkv']} (clamping q/k/v) is not supported")
    num_layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = set(config.get("mlp_only_layers") or [])
    return dict(
        num_experts=int(config.get(_MOE[architecture]) or config.get("num_local_experts") or config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        # Mixtral always renormalizes; the Qwen-MoE and OLMoE configs say so in norm_topk_prob
        moe_renormalize=architecture == "MixtralForCausalLM" or bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0)
        if architecture == "Qwen2MoeForCausalLM" else 0,
        dense_mlp_layers=tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step),
    )


def eos_ids_of(value: Any) -> set[int]:
    """eos_token_id as found in a config: None, an int, or a list of ints."""
    if value is None:
        return set()
    if isinstance(value, list):
        return {int(v) for v in value}
    return {int(value)}


def hf_eos_token_ids(model_dir: Path, config: dict[str, Any]) -> set[int]:
    """EOS ids from config.json and, when present, generation_config.json."""
    ids = eos_ids_of(config.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids |= eos_ids_of(read_json(gen_path).get("eos_token_id"))
    return ids
