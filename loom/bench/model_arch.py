"""Architecture figures of a Llama-family checkpoint, read from metadata only (no weights loaded).

GGUF files are read with the `gguf` library's GGUFReader, which memory-maps the file: only the key/value
fields and the tensor-info table are touched. Hugging Face directories are read from config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelArch:
    name: str  # human-readable model name
    num_layers: int  # L, transformer blocks
    hidden_size: int  # d_model, elements
    num_heads: int  # H, query heads
    num_kv_heads: int  # H_kv, key/value heads
    head_dim: int  # d_h, elements per head
    intermediate_size: int  # FFN width, elements
    vocab_size: int  # V, tokens
    tie_word_embeddings: bool  # lm_head shares the token-embedding matrix
    max_position_embeddings: int  # context length the model was trained for, tokens
    stored_weight_bytes: int | None = None  # bytes of all tensors as stored in the file (GGUF quantized); None if unknown
    # bytes a decode step reads when loom runs the file packed (quantization "gguf": loom's layouts per GGML
    # type, loom/quant/gguf_repack.PACKED_BYTES_PER_WEIGHT; the untied input embedding excluded); None if unknown
    packed_decode_bytes: int | None = None
    qk_norm: str | None = None  # q/k RMSNorm weights per layer: "per_head" [d_h] each (Qwen3), "projection" (OLMo 2)
    num_experts: int = 0  # E, SwiGLU experts per layer of a mixture-of-experts model (0: dense)
    experts_per_tok: int = 0  # k, experts each token runs
    moe_intermediate_size: int = 0  # F_e, width of an expert (0: intermediate_size)
    shared_expert_intermediate_size: int = 0  # F_s, the shared expert every token runs (Qwen2-MoE), 0: none
    num_dense_mlp_layers: int = 0  # layers of an MoE model that keep the dense MLP
    # Gemma: layers that attend only to the last `sliding_window` tokens (their KV is read, and with loom's hybrid KV
    # cache held, for that window only); four norms per layer instead of two
    sliding_window: int | None = None  # W, tokens; None: every layer attends to the whole context
    num_sliding_layers: int = 0  # L_s
    sandwich_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_sliding_layers <= self.num_layers or (self.num_sliding_layers and not self.sliding_window):
            raise ValueError(f"num_sliding_layers must be in 0..{self.num_layers}, with a sliding_window")

    def attended_context(self, context: float) -> float:
        """Keys a query reads per layer on average at context C: ((L - L_s)·C + L_s·min(C, W)) / L."""
        s = self.num_sliding_layers
        return ((self.num_layers - s) * context + s * min(context, self.sliding_window or 0)) / self.num_layers

    def attended_pairs(self, num_tokens: int) -> float:
        """(query, key) pairs per layer on average in a causal prefill of N tokens, as areas: N²/2 for a full
        layer, W²/2 + (N - W)·W for a sliding one (N > W)."""
        n, s = num_tokens, self.num_sliding_layers
        full = n * n / 2
        if not s:
            return full
        w = self.sliding_window or 0
        sliding = full if n <= w else w * w / 2 + (n - w) * w
        return ((self.num_layers - s) * full + s * sliding) / self.num_layers

    @property
    def num_params(self) -> int:
        """Parameter count P of a Llama block stack (no biases).

        P = V·d·(1 if tied else 2) + L·(d·H·d_h + 2·d·H_kv·d_h + H·d_h·d + 3·d·F + 2·d [+ 2·d_h]) + d
        (q, k, v, o projections; gate, up, down; two RMSNorm weights per layer, plus the q and k norms with
        QK-norm; final norm). A mixture-of-experts layer has E experts of 3·d·F_e, the router E·d and a shared
        expert 3·d·F_s + d in place of 3·d·F.
        """
        return self._count(self.num_experts)

    def _count(self, experts: int) -> int:
        """Parameters with `experts` of each MoE layer's experts (all E: the total; k: those a token runs)."""
        d, dh = self.hidden_size, self.head_dim
        attn = d * self.num_heads * dh * 2 + 2 * d * self.num_kv_heads * dh
        if self.qk_norm == "per_head":
            attn += 2 * dh
        elif self.qk_norm == "projection":
            attn += (self.num_heads + self.num_kv_heads) * dh
        dense = 3 * d * self.intermediate_size
        mlp = self.num_layers * dense
        if self.num_experts:
            sparse = experts * 3 * d * (self.moe_intermediate_size or self.intermediate_size) + self.num_experts * d
            if self.shared_expert_intermediate_size:
                sparse += 3 * d * self.shared_expert_intermediate_size + d
            moe_layers = self.num_layers - self.num_dense_mlp_layers
            mlp = self.num_dense_mlp_layers * dense + moe_layers * sparse
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * (attn + (4 if self.sandwich_norm else 2) * d) + mlp + d

    @property
    def num_decode_params(self) -> int:
        """Parameters read and multiplied for every decoded token.

        Everything except the input embedding table when it is untied (a lookup reads only B rows).
        With tied embeddings the lm_head matmul reads the whole table, so this equals num_params. A
        mixture-of-experts model counts the k experts a token runs, not all E (its active parameters; a batch
        whose tokens pick different experts reads more of them).
        """
        active = self._count(self.experts_per_tok)
        if self.tie_word_embeddings:
            return active
        return active - self.vocab_size * self.hidden_size


def load_model_arch(model: str | Path | None) -> ModelArch:
    """Read the architecture of a GGUF file or a Hugging Face directory (None = the bundled default).

    Raises:
        ValueError: `model` is neither a .gguf file nor a directory with config.json.
    """
    if model is None:
        from loom.model.loader import default_model_path  # the loader imports torch: not for `loom --help`

        path = default_model_path()
    else:
        path = check_model_arch_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _arch_from_gguf(path)
    return _arch_from_hf_config(json.loads((path / "config.json").read_text()), path.name)


def check_model_arch_path(model: str | Path) -> Path:
    """`model` as a path whose architecture load_model_arch reads: a .gguf file or a directory with config.json.

    Raises:
        ValueError: it is neither.
    """
    path = Path(model)
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()):
        return path
    raise ValueError(f"model must be a .gguf file or a directory with config.json, got {str(path)!r}")


def _arch_from_gguf(path: Path) -> ModelArch:
    from gguf import GGUFReader  # local: only this path needs it

    reader = GGUFReader(path)

    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = str(field("general.architecture"))
    d = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    sliding: dict[str, object] = {}
    if arch in ("gemma2", "gemma3"):  # the layer pattern is llama.cpp's convention: the engine's own reading
        from loom.model.loader.gguf import gguf_arch_config

        engine_arch = gguf_arch_config(reader)
        sliding = _sliding_fields(engine_arch)
    return ModelArch(
        name=str(field("general.name", path.stem)),
        num_layers=int(field(f"{arch}.block_count")),
        hidden_size=d,
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", d // heads)),
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        stored_weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        packed_decode_bytes=_packed_decode_bytes(reader, tied="output.weight" not in tensor_names),
        qk_norm="per_head" if "blk.0.attn_q_norm.weight" in tensor_names else None,
        **sliding,
    )


def _sliding_fields(a: object) -> dict[str, object]:
    """ModelArch's sliding-window and norm fields of an engine ModelArchConfig (loom/model/arch.py)."""
    windows = [a.layer_sliding_window(i) for i in range(a.num_layers)]  # type: ignore[attr-defined]
    num_sliding = sum(w is not None for w in windows)
    return dict(sliding_window=a.sliding_window if num_sliding else None,  # type: ignore[attr-defined]
                num_sliding_layers=num_sliding, sandwich_norm=a.sandwich_norm)  # type: ignore[attr-defined]


def _packed_decode_bytes(reader: object, tied: bool) -> int:
    """Bytes of the 2-D weights a decode step reads in loom's packed layouts (others: float32, the dtype
    loom's packed path computes in on CPUs without native bf16)."""
    from loom.quant.gguf_repack import PACKED_BYTES_PER_WEIGHT

    total = 0.0
    for t in reader.tensors:
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and not tied):
            continue
        total += int(t.n_elements) * PACKED_BYTES_PER_WEIGHT.get(t.tensor_type.name, 4.0)
    return int(total)


def _arch_from_hf_config(cfg: dict[str, object], name: str) -> ModelArch:
    """The engine's own reading of config.json (loom.model.loader.hf_config), as a ModelArch.

    Raises:
        ValueError: what hf_arch_config raises (a missing key, an unsupported variation).
    """
    from loom.model.loader.hf_config import hf_arch_config

    if not cfg.get("architectures") and not cfg.get("model_type"):  # a bare shape description: the Llama family
        cfg = {**cfg, "model_type": "llama"}
    a = hf_arch_config(cfg)
    return ModelArch(
        name=name, num_layers=a.num_layers, hidden_size=a.hidden_size, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size, tie_word_embeddings=a.tie_word_embeddings,
        max_position_embeddings=a.max_position_embeddings, qk_norm=a.qk_norm, num_experts=a.num_experts,
        experts_per_tok=a.num_experts_per_tok, moe_intermediate_size=a.moe_intermediate_size,
        shared_expert_intermediate_size=a.shared_expert_intermediate_size,
        num_dense_mlp_layers=len(a.dense_mlp_layers) if a.num_experts else 0, **_sliding_fields(a),
    )
