"""Architecture figures of a Llama-family checkpoint, read from metadata only (no weights loaded).

GGUF files are read with the `gguf` library's GGUFReader, which memory-maps the file: only the key/value
fields and the tensor-info table are touched. Hugging Face directories are read from config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loom.model.loader import default_model_path


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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_params(self) -> int:
        """Parameter count P of a Llama block stack (no biases).

        P = V·d·(1 if tied else 2) + L·(d·H·d_h + 2·d·H_kv·d_h + H·d_h·d + 3·d·F + 2·d [+ 2·d_h]) + d
        (q, k, v, o projections; gate, up, down; two RMSNorm weights per layer, plus the q and k norms with
        QK-norm; final norm).
        """
        d, dh = self.hidden_size, self.head_dim
        attn = d * self.num_heads * dh * 2 + 2 * d * self.num_kv_heads * dh
        if self.qk_norm == "per_head":
            attn += 2 * dh
        elif self.qk_norm == "projection":
            attn += (self.num_heads + self.num_kv_heads) * dh
        mlp = 3 * d * self.intermediate_size
        if self.num_experts:  # E experts and the router [E, d]
            mlp = self.num_experts * mlp + self.num_experts * d
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * per_layer + d

    @property
    def num_decode_params(self) -> int:
        """Parameters read and multiplied for every decoded token.

        Everything except the input embedding table when it is untied (a lookup reads only B rows).
        With tied embeddings the lm_head matmul reads the whole table, so this equals num_params. A
        mixture-of-experts model counts the k experts a token runs, not all E (its active parameters; a batch
        whose tokens pick different experts reads more of them).
        """
        inactive = 0
        if self.num_experts:
            inactive = self.num_layers * (self.num_experts - self.experts_per_tok) * 3 * self.hidden_size \
                * self.intermediate_size
        if self.tie_word_embeddings:
            return self.num_params - inactive
        return self.num_params - self.vocab_size * self.hidden_size - inactive


def load_model_arch(model: str | Path | None) -> ModelArch:
    """Read the architecture of a GGUF file or a Hugging Face directory (None = the bundled default).

    Raises:
        ValueError: `model` is neither a .gguf file nor a directory with config.json.
    """
    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _arch_from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _arch_from_hf_config(json.loads((path / "config.json").read_text()), path.name)
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
    )


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
    d = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return ModelArch(
        name=name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=d,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or d // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        qk_norm={"qwen3": "per_head", "olmo2": "projection"}.get(str(cfg.get("model_type"))),
        num_experts=int(cfg.get("num_local_experts") or 0),
        experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if cfg.get("num_local_experts") else 0,
    )
