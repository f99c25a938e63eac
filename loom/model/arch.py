"""ModelArchConfig: the architecture facts the model, the KV cache and the scheduler need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def gemma_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's layer pattern when a checkpoint does not list it: every `pattern`-th layer global, the rest sliding
    (transformers 4's sliding_window_pattern; llama.cpp's set_swa_pattern: 2 for Gemma 2, 6 for Gemma 3)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


def gemma_fields(hidden_size: int, query_pre_attn_scalar: float, layer_types: tuple[str, ...],
                 rope_local_theta: float | None, attn_logit_softcapping: float | None,
                 final_logit_softcapping: float | None) -> dict[str, Any]:
    """ModelArchConfig's Gemma 2 / 3 fields, whatever the checkpoint format: the given layer pattern, local rotary
    base and soft-caps, and the family's fixed numerics (sandwich norms with (1 + w) weights, GeGLU, embeddings
    scaled by sqrt(hidden_size), softmax scale query_pre_attn_scalar ** -0.5)."""
    return dict(
        layer_types=layer_types, rope_local_theta=rope_local_theta, sandwich_norm=True, norm_weight_offset=1.0,
        hidden_act="gelu_pytorch_tanh", embedding_scale=float(hidden_size) ** 0.5,
        attention_scale=float(query_pre_attn_scalar) ** -0.5,
        attn_logit_softcapping=None if attn_logit_softcapping is None else float(attn_logit_softcapping),
        final_logit_softcapping=None if final_logit_softcapping is None else float(final_logit_softcapping),
    )


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Shape and numerics of a Llama-family decoder, whatever checkpoint format it came from."""

    architecture: str  # registry key, e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    num_layers: int  # decoder layers
    hidden_size: int  # model width d_model
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== num_heads: MHA, 1: MQA, else GQA)
    head_dim: int  # features per head
    intermediate_size: int  # MLP width
    vocab_size: int  # rows of the embedding / columns of the logits
    max_position_embeddings: int  # tokens the model was trained for (context length)
    rope_theta: float  # rotary base frequency
    rope_scaling: dict[str, Any] | None  # {"rope_type": "linear"|"llama3", ...}; None = plain rotary
    rms_norm_eps: float  # epsilon inside RMSNorm
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None  # tokens each query may look back (Mistral); None = full attention
    # RMSNorm of q and k before rotary: None; "per_head": one weight [head_dim] for every q head and one for every
    # k head (Qwen3); "projection": over the whole q projection [num_heads * head_dim] and k [num_kv_heads *
    # head_dim] (OLMo 2)
    qk_norm: str | None = None
    post_norm: bool = False  # norms on the attention and MLP outputs, before each residual add, none on inputs (OLMo 2)
    num_experts: int = 0  # mixture-of-experts FFN: experts per layer (0 = the dense SwiGLU MLP)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of each expert's MLP (0 = intermediate_size)
    moe_renormalize: bool = True  # top-k probabilities renormalized to sum to 1 (Mixtral; Qwen-MoE norm_topk_prob)
    shared_expert_intermediate_size: int = 0  # a shared expert every token runs, sigmoid-gated (Qwen2-MoE); 0 = none
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP (Qwen-MoE mlp_only_layers)
    # Gemma 2 / 3
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention" | "full_attention"; None = all alike
    rope_local_theta: float | None = None  # rotary base of the sliding layers, unscaled (Gemma 3); None = rope_theta
    sandwich_norm: bool = False  # norms before and after both attention and MLP, 4 per layer (Gemma 2 / 3)
    norm_weight_offset: float = 0.0  # the checkpoint's RMSNorm weight w scales by (offset + w) (Gemma: 1.0)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU, Gemma)
    embedding_scale: float | None = None  # embedding rows are multiplied by it (Gemma: sqrt(hidden_size)); None = 1
    attention_scale: float | None = None  # softmax scale (Gemma: query_pre_attn_scalar ** -0.5); None = head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before softmax (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    def __post_init__(self) -> None:
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
            if unknown:
                raise ValueError(f"layer_types: unknown kinds {sorted(unknown)}; known: full_attention, sliding_attention")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if self.qk_norm not in (None, "per_head", "projection"):
            raise ValueError(f"qk_norm must be None, 'per_head' or 'projection', got {self.qk_norm!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def layer_sliding_window(self, layer: int) -> int | None:
        """Tokens layer `layer`'s queries look back (query included), None = full attention."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope_is_local(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local rotary base (a sliding layer of Gemma 3)."""
        return self.rope_local_theta is not None and self.layer_sliding_window(layer) is not None

    @property
    def sliding_window_all_layers(self) -> int | None:
        """The window when every layer slides by the same one (Mistral), else None: what the KV cache manager may
        free early for every layer alike."""
        windows = {self.layer_sliding_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None
