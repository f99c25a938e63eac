"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

Architecture: Touvron et al. 2023 (arXiv:2302.13971): pre-norm RMSNorm, RoPE, SwiGLU MLP, GQA. The variations
are named fields of ModelArchConfig: q/k/v biases (Qwen2), a sliding window (Mistral), QK-norm (an RMSNorm of
the queries and keys before rotary: per head in Qwen3, Qwen3 technical report, arXiv:2505.09388; over the whole
projection in OLMo 2, arXiv:2501.00656) and post-norm layers (OLMo 2: the attention and MLP outputs are normed
before each residual add, the inputs are not).
Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are stored
stacked (qkv_proj, gate_up_proj) so each is one matmul; `load_weights` does the stacking.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.attention.backend import AttentionBackend
from loom.attention.metadata import AttentionMetadata
from loom.distributed.pipeline_parallel import PipelineParallel
from loom.distributed.tensor_parallel import TensorParallel, head_shard, partition, shard_range
from loom.kernels.registry import fused_kernels_for
from loom.model.arch import ModelArchConfig
from loom.model.huge_pages import place_weights_on_huge_pages
from loom.quant.config import NoQuantConfig, QuantizationConfig
from loom.quant.layout import INTERLEAVED, deinterleave_rows16
from loom.model.layers import (
    Linear,
    LinearShard,
    LMHead,
    MergedLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    apply_rotary,
)

# checkpoint projection -> (stacked parameter, shard index); Mixtral's experts name gate / up / down w1 / w3 / w2
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
            "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}  # fmt: skip
# checkpoint module names that are another name of ours
_RENAMED = {"block_sparse_moe": "mlp", "w2": "down_proj"}


def _rms_norm(width: int, arch: ModelArchConfig, kernels: Any, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    """An RMSNorm [width] with the model's epsilon, in the model dtype on its device."""
    return RMSNorm(width, arch.rms_norm_eps, kernels).to(dtype=dtype, device=device)


def _feed_forward(arch: ModelArchConfig, layer_index: int, dtype: torch.dtype, device: torch.device,
                  quant_config: QuantizationConfig, prefix: str, tp: TensorParallel | None) -> nn.Module:
    """A layer's FFN: the MoE block in the sparse layers of an MoE model, else the dense gated MLP."""
    if arch.num_experts and layer_index not in arch.dense_mlp_layers:
        return SparseMoeBlock(arch, dtype, device, quant_config, prefix, tp)
    return LlamaMLP(arch.hidden_size, arch.intermediate_size, dtype, device, quant_config, prefix, arch.hidden_act,
                    tp)


def _layer_index(prefix: str) -> int:
    """i of a module prefix "model.layers.{i}"."""
    return int(prefix.rsplit(".", 1)[-1])


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        o_proj_bias: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig,
        prefix: str,
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: this rank computes the heads of head_shard (q/k/v column-parallel by heads, o_proj row-parallel)."""
        super().__init__()
        heads = head_shard(arch.num_heads, arch.num_kv_heads, tp)  # (load_model refuses what does not split)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, arch.head_dim
        d = arch.head_dim
        q_size, kv_size = heads.num_heads * d, heads.num_kv_heads * d
        q_rows = (heads.q_start * d, heads.q_start * d + q_size)
        kv_rows = (heads.kv_start * d, heads.kv_start * d + kv_size)
        self.qkv_proj = MergedLinear(arch.hidden_size, [q_size, kv_size, kv_size], arch.attention_bias, dtype, device,
                                     quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
                                     shard=None if tp is None else LinearShard(tp, rows=(q_rows, kv_rows, kv_rows)))
        self.o_proj = Linear(q_size, arch.hidden_size, o_proj_bias, dtype, device,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj",
                             shard=None if tp is None else LinearShard(tp, cols=q_rows))
        self.kernels: Any = fused_kernels_for(dtype, device, quant_config.float32_kernels)  # fused rotary, or None
        layer_index = _layer_index(prefix.rsplit(".", 1)[0])
        self.attn = PagedAttention(heads.num_heads, heads.num_kv_heads, arch.head_dim, backend,
                                   arch.layer_sliding_window(layer_index), arch.attention_scale,
                                   arch.attn_logit_softcapping)
        self.local_rope = arch.layer_rope_is_local(layer_index)  # rotates with the local base (Gemma 3 sliding)
        # QK-norm: one RMSNorm [head_dim] shared by all query heads and one by all key heads (Qwen3), or one over
        # the whole q projection and one over k (OLMo 2)
        self.qk_norm = arch.qk_norm
        self.q_norm = self.k_norm = None
        if arch.qk_norm is not None:
            per_head = arch.qk_norm == "per_head"
            q_width, k_width = (arch.head_dim, arch.head_dim) if per_head else (arch.q_size, arch.kv_size)
            self.q_norm = _rms_norm(q_width, arch, self.kernels, dtype, device)
            self.k_norm = _rms_norm(k_width, arch, self.kernels, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [n, (H + 2 H_kv) d]
        rope_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :rope_width].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:  # rows of one head each ("per_head") or of a token's whole q / k
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            rows = (-1, self.head_dim) if self.qk_norm == "per_head" else (n, -1)
            q = self.q_norm(q.reshape(rows)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(rows)).view(n, self.num_kv_heads, self.head_dim)
            qk = torch.cat([q, k], dim=1)
        # q and k side by side are rotated in one pass: [n, H + H_kv, d], then split back (views).
        qk = apply_rotary(qk, *cos_sin, self.kernels)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, rope_width:].view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaMLP(nn.Module):
    """Gated feed-forward (Shazeer 2020, arXiv:2002.05202): down(act(gate(x)) * up(x)), act = SiLU (SwiGLU) or
    GELU with the tanh approximation (GeGLU, Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 quant_config: QuantizationConfig, prefix: str, act: str = "silu", tp: TensorParallel | None = None,
                 reduce: bool = True) -> None:
        """tp: this rank holds a range of the MLP width (gate/up column-parallel, down row-parallel); reduce=False
        leaves the down projection's partial sums for the caller to add (an MoE block adds all experts' once)."""
        super().__init__()
        self.act = act
        start, stop = shard_range(intermediate_size, tp, align=32)  # whole groups of packed weights per rank
        width = stop - start
        self.gate_up_proj = MergedLinear(hidden_size, [width, width], False, dtype, device, quant_config=quant_config,
                                         prefix=f"{prefix}.gate_up_proj",
                                         shard=None if tp is None else LinearShard(tp, rows=((start, stop),) * 2))
        self.down_proj = Linear(width, hidden_size, False, dtype, device, quant_config=quant_config,
                                prefix=f"{prefix}.down_proj",
                                shard=None if tp is None else LinearShard(tp, cols=(start, stop), reduce=reduce))
        self.kernels: Any = fused_kernels_for(dtype, device, quant_config.float32_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_pytorch_tanh":
            if self.kernels is not None:  # loom's GeGLU, the one the C decode step runs (within ulps of torch's)
                act = self.kernels.gelu_tanh_mul(gate_up)
                if act is not None:
                    return self.down_proj(act)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        if self.kernels is not None:
            act = self.kernels.silu_mul(gate_up)  # one C call for bf16 on CPU, None otherwise
            if act is not None:
                return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: silu's output is a fresh tensor


class SparseMoeBlock(nn.Module):
    """Mixture-of-experts FFN (Mixtral, Jiang et al. 2024, arXiv:2401.04088): a router picks each token's top-k of
    E SwiGLU experts by softmax probability, renormalized over the k; the output is the probability-weighted sum
    of those experts' outputs.

    Tokens are grouped by expert: one sort of the (token, slot) pairs by expert id, then each expert that got
    tokens runs once on all of them (no per-token loop), and the weighted outputs are added back per token in
    expert order, as transformers' MixtralExperts adds them. The router stays dense in the model dtype (its
    logits decide the routing); each expert's projections go through the quantization seam like any MLP's.
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 quant_config: QuantizationConfig, prefix: str, tp: TensorParallel | None = None) -> None:
        """tp: every expert's MLP width is split over the ranks and the block adds the ranks' partial sums once;
        or, with tp.expert_parallel, each rank holds whole experts (a contiguous range) and tokens travel to their
        experts' ranks and back (all-to-all; GShard, Lepikhin et al. 2020, arXiv:2006.16668)."""
        super().__init__()
        self.tp = tp
        self.ep = tp if tp is not None and tp.expert_parallel else None
        num_experts = arch.num_experts
        self.expert_start, self.expert_stop = (0, num_experts) if self.ep is None else \
            partition(num_experts, self.ep.size, self.ep.rank)
        # rank holding each expert (expert parallel): each rank's contiguous range, expanded
        self.expert_owner = None if self.ep is None else torch.repeat_interleave(
            torch.arange(self.ep.size),
            torch.tensor([b - a for a, b in (partition(num_experts, self.ep.size, r) for r in range(self.ep.size))]))
        # tokens routed to each expert since start-up, summed over the steps (load-balance metrics)
        self.expert_tokens = torch.zeros(num_experts, dtype=torch.int64)
        # rows whose routing expert_tokens counts (indices into x); None = all. A context-parallel rank other than 0
        # counts only its share of the split chunks (rank 0 counts the rows every rank runs), summed into rank 0's
        self.counted_rows: torch.Tensor | None = None
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.moe_renormalize
        self.gate = Linear(arch.hidden_size, arch.num_experts, False, dtype, device, quant_config=NoQuantConfig(),
                           prefix=f"{prefix}.gate")
        width = arch.moe_intermediate_size or arch.intermediate_size
        self.experts = nn.ModuleList(
            (LlamaMLP(arch.hidden_size, width, dtype, device, quant_config, f"{prefix}.experts.{e}", tp=tp,
                      reduce=False) if self.ep is None else
             LlamaMLP(arch.hidden_size, width, dtype, device, quant_config, f"{prefix}.experts.{e}")
             if self.expert_start <= e < self.expert_stop else PPMissingLayer())
            for e in range(arch.num_experts)
        )
        # Qwen2-MoE: a shared expert every token runs, scaled by sigmoid(shared_expert_gate(x))
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(arch.hidden_size, arch.shared_expert_intermediate_size, dtype, device,
                                          quant_config, f"{prefix}.shared_expert", tp=tp, reduce=False)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, False, dtype, device, quant_config=NoQuantConfig(),
                                             prefix=f"{prefix}.shared_expert_gate")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, top_k] float32, expert ids [n, top_k] int64): the top-k softmax
        probabilities, renormalized over the k where the family does (Mixtral; Qwen-MoE's norm_topk_prob)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden], x's dtype."""
        weights, ids = self.route(x)
        counted = ids if self.counted_rows is None else ids.index_select(0, self.counted_rows)
        self.expert_tokens += torch.bincount(counted.flatten(), minlength=len(self.experts)).cpu()
        if self.ep is not None:
            return self._forward_expert_parallel(x, weights, ids)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                y = self.experts[e](x.index_select(0, rows))
                out.index_add_(0, rows, (y * weights.flatten()[order[start : start + count], None]).to(x.dtype))
            start += count
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _forward_expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel: this rank dispatches its share of the tokens (x is the same on every rank) to the ranks
        holding their experts, runs the rows sent to its own experts, sends the results back, weights and adds them
        per token in expert order (as the unsplit block does), and the ranks' token shares are gathered."""
        ep = self.ep
        assert ep is not None and self.expert_owner is not None
        n = x.shape[0]
        counts = [b - a for a, b in (partition(n, ep.size, r) for r in range(ep.size))]
        start, stop = partition(n, ep.size, ep.rank)
        flat = ids[start:stop].flatten()
        owner = self.expert_owner.to(flat.device)[flat]
        order = torch.argsort(owner * len(self.experts) + flat, stable=True)  # by rank, then expert: expert order
        tokens = torch.arange(start, stop, device=x.device).repeat_interleave(self.top_k)[order]
        send = torch.bincount(owner, minlength=ep.size)
        recv = ep.all_to_all(send, [1] * ep.size, [1] * ep.size)  # how many rows each rank sends here
        send_counts, recv_counts = send.tolist(), recv.tolist()
        rows = ep.all_to_all(x.index_select(0, tokens), send_counts, recv_counts)
        experts = ep.all_to_all(flat[order], send_counts, recv_counts)
        out = torch.empty_like(rows)
        for e in range(self.expert_start, self.expert_stop):
            mine = (experts == e).nonzero().flatten()
            if mine.numel():
                out[mine] = self.experts[e](rows.index_select(0, mine))
        back = ep.all_to_all(out, recv_counts, send_counts)
        local = torch.zeros(stop - start, x.shape[1], dtype=x.dtype, device=x.device)
        local.index_add_(0, tokens - start, (back * weights[start:stop].flatten()[order, None]).to(x.dtype))
        combined = ep.all_gather_rows(local, counts)
        if self.shared_expert is not None:  # split by width over the same ranks: its partial sums are added here
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            combined = combined + ep.all_reduce(shared)
        return combined

    def expert_token_counts(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert [num_experts] int64 for x [n, hidden] (load-balance metrics)."""
        return torch.bincount(self.route(x)[1].flatten(), minlength=len(self.experts))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        o_proj_bias: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig,
        prefix: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        kernels = fused_kernels_for(dtype, device, quant_config.float32_kernels)
        self.input_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)
        self.self_attn = LlamaAttention(arch, o_proj_bias, backend, dtype, device, quant_config, f"{prefix}.self_attn",
                                        tp)
        self.post_attention_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)
        self.mlp = _feed_forward(arch, _layer_index(prefix), dtype, device, quant_config, f"{prefix}.mlp", tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [num_tokens, hidden_size] -> (this layer's MLP output, residual stream before
        it). The residual add is fused into the next norm; residual None = first layer (hidden is the
        embedding). Same sums as hidden + attn(norm(hidden)), then + mlp(norm(...))."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, cos_sin, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(normed), residual


class Olmo2DecoderLayer(nn.Module):
    """A post-norm layer (OLMo 2): x + norm(attn(x)), then h + norm(mlp(h)); no norm on the inputs."""

    def __init__(
        self,
        arch: ModelArchConfig,
        o_proj_bias: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig,
        prefix: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        kernels = fused_kernels_for(dtype, device, quant_config.float32_kernels)
        self.self_attn = LlamaAttention(arch, o_proj_bias, backend, dtype, device, quant_config, f"{prefix}.self_attn",
                                        tp)
        self.post_attention_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)
        self.mlp = _feed_forward(arch, _layer_index(prefix), dtype, device, quant_config, f"{prefix}.mlp", tp)
        self.post_feedforward_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (hidden, residual) convention of LlamaDecoderLayer: the layer input is hidden + residual (hidden
        alone for the first layer); returns (norm(mlp(h)), h) with h = x + norm(attn(x)), whose sum the next layer
        (or the final norm) takes."""
        x = hidden if residual is None else hidden + residual
        h = x + self.post_attention_layernorm(self.self_attn(self._attn_input(x), cos_sin, kv_cache, attn_metadata))
        return self.post_feedforward_layernorm(self.mlp(self._mlp_input(h))), h

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return x  # OLMo 2 norms no input

    def _mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return h


class GemmaDecoderLayer(Olmo2DecoderLayer):
    """A sandwich-norm layer (Gemma 2 / 3): OLMo 2's post-norm layer with norms on the attention and MLP inputs
    too, h = x + post_attn_norm(attn(input_norm(x))), then h + post_ffw_norm(mlp(pre_ffw_norm(h)))."""

    def __init__(
        self,
        arch: ModelArchConfig,
        o_proj_bias: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig,
        prefix: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(arch, o_proj_bias, backend, dtype, device, quant_config, prefix, tp)
        kernels = fused_kernels_for(dtype, device, quant_config.float32_kernels)
        self.input_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)
        self.pre_feedforward_layernorm = _rms_norm(arch.hidden_size, arch, kernels, dtype, device)

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def _mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.pre_feedforward_layernorm(h)


class PPMissingLayer(nn.Module):
    """A module another rank holds (a pipeline stage's decoder layer, an expert-parallel rank's expert): no
    parameters, never called."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipeline stage ran a layer it does not hold")


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        o_proj_bias: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig,
        tp: TensorParallel | None = None,
        pp: PipelineParallel | None = None,
    ) -> None:
        """pp: this rank's pipeline stage: it holds its layers only (the others are PPMissingLayer), the embedding
        on the first stage (and the last, for a tied LM head)."""
        super().__init__()
        self.pp = pp
        holds_embedding = pp is None or pp.is_first or (pp.is_last and arch.tie_word_embeddings)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype, device,
                                           packed=quant_config.embedding_packed(), tp=tp) if holds_embedding else None
        # Gemma multiplies the embedding rows by sqrt(hidden_size), a float32 scalar cast to the model dtype
        self.embedding_scale = None if arch.embedding_scale is None else \
            torch.tensor(arch.embedding_scale, dtype=torch.float32).to(dtype)
        layer_cls = GemmaDecoderLayer if arch.sandwich_norm else Olmo2DecoderLayer if arch.post_norm \
            else LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(arch, o_proj_bias, backend, dtype, device, quant_config, f"model.layers.{i}", tp)
            if pp is None or pp.holds_layer(i) else PPMissingLayer()
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps,
                            fused_kernels_for(dtype, device, quant_config.float32_kernels)).to(dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        ).to(device=device)
        # Gemma 3's sliding layers rotate with their own base and no scaling
        self.rotary_emb_local = None if arch.rope_local_theta is None else RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_local_theta, None).to(device=device)
        self.decode_step: Any = None  # ModelDecodeStep once loaded, when the model is what it runs

    def prepare_decode_step(self) -> None:
        """Record the packed weights for loom's one-call C decode step (loom/kernels/decode_step.py) when every
        layer is what it runs; else keep the per-layer path. LOOM_DECODE_STEP=0 keeps the per-layer path;
        LOOM_SPARSE_DECODE_STEP=0 keeps it for block-sparse decode attention only (both switches are on by default
        and take 0/false/no/off, loom/env.py).

        Raises:
            ValueError: either switch is set to a value that is not on/off."""
        from loom.env import env_flag
        from loom.kernels.decode_step import ModelDecodeStep, supports_model
        from loom.kernels.registry import get_kernel
        from loom.quant.methods import DENSE_MIN_ROWS

        self.decode_step = None
        if self.pp is not None or self.embed_tokens.tp is not None:  # the C step has no collectives
            return
        if getattr(self.layers[0].self_attn.attn.backend, "sparse", None) is not None \
                and not env_flag("LOOM_SPARSE_DECODE_STEP", True):
            return  # block-sparse decode on the per-layer path (selection in torch); default: inside the C step
        if not env_flag("LOOM_DECODE_STEP", True) or not supports_model(self):
            return
        kernel = get_kernel("decode_step")
        if kernel is not None:
            self.decode_step = ModelDecodeStep(kernel, self, max_rows=DENSE_MIN_ROWS)

    def _longrope_rows(self, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor | None:
        """LongRoPE (Phi-3 128k): which tokens take the long factors. transformers switches a forward pass to
        them once its largest position reaches original_max_position_embeddings; loom decides the same per
        request and step (a request's tokens of this step take the long table when its last one is at or past
        that position), so a prompt prefilled in one chunk and each decoded token rotate as transformers rotates
        them. None without LongRoPE."""
        long_from = self.rotary_emb.long_from
        if long_from is None or positions.numel() == 0:
            return None
        meta = attn_metadata[0] if isinstance(attn_metadata, list) else attn_metadata
        starts = meta.query_start_loc_cpu
        lengths = torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)], device=positions.device)
        if meta.context_parallel is not None:  # this rank holds a share of a split chunk: decide by its last token
            last = torch.tensor(meta.context_parallel.longrope_ends, dtype=torch.int64, device=positions.device)
            return (last >= long_from).repeat_interleave(lengths[lengths > 0])
        ends = torch.tensor([b - 1 for a, b in zip(starts, starts[1:], strict=False) if b > a],
                            dtype=torch.int64, device=positions.device)
        flags = positions.index_select(0, ends) >= long_from
        return flags.repeat_interleave(lengths[lengths > 0])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata | list[AttentionMetadata],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """attn_metadata: one for every layer, or each layer's (a hybrid KV cache: one per group of layers).
        Pipeline stages: a later stage starts from `intermediate` = the previous stage's (hidden, residual)
        [num_tokens, hidden_size] instead of input_ids, and every stage but the last returns its (hidden,
        residual) for the next."""
        cos_sin = self.rotary_emb.cos_sin(positions, self._longrope_rows(positions, attn_metadata))
        cos_sin_local = None if self.rotary_emb_local is None else self.rotary_emb_local.cos_sin(positions)
        residual: torch.Tensor | None = None
        if intermediate is not None:
            hidden, residual = intermediate
        else:
            hidden = self.embed_tokens(input_ids)
            if self.embedding_scale is not None:
                hidden = hidden * self.embedding_scale
        # a pure decode step in one C call, when it serves this step (not while KV retention scores the attention:
        # that needs each layer's queries)
        # (nor on a context-parallel share of a prefill, whose attention waits for the other ranks' K/V)
        if (self.decode_step is not None and getattr(attn_metadata, "kv_scores", None) is None
                and getattr(attn_metadata, "context_parallel", None) is None):
            out = self.decode_step.run(hidden, cos_sin, kv_caches, attn_metadata, cos_sin_local)
            if out is not None:
                return out
        per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, per_layer, strict=True):
            if isinstance(layer, PPMissingLayer):
                continue
            layer_cos_sin = cos_sin_local if layer.self_attn.local_rope else cos_sin
            hidden, residual = layer(hidden, residual, layer_cos_sin, kv_cache, meta)
        if self.pp is not None and not self.pp.is_last:
            assert residual is not None  # every stage holds at least one layer
            return hidden, residual
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Build with the target dtype/device, then `load_weights`.

    Do not call `.to(dtype)` afterwards: the rotary table must stay float32.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        quant_config: QuantizationConfig | None = None,
        o_proj_bias: bool | None = None,
        *,
        tp: TensorParallel | None = None,
        pp: PipelineParallel | None = None,
    ) -> None:
        """quant_config: which method each linear layer gets (None = dense, loom.quant.NoQuantConfig);
        o_proj_bias: None = same as arch.attention_bias (Llama); Qwen2 passes False; tp: this process's place in
        a tensor-parallel group (None = the whole model here; loom/distributed/tensor_parallel.py); pp: this
        process's pipeline stage (its layers only; the LM head on the last stage; loom/distributed/pipeline_parallel.py)."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.pp = pp
        quant_config = quant_config or NoQuantConfig()
        self.quant_config = quant_config
        bias = arch.attention_bias if o_proj_bias is None else o_proj_bias
        self.model = LlamaModel(arch, bias, backend, dtype, device, quant_config, tp, pp)
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype, device, tied, quant_config=quant_config,
                              tp=tp) if pp is None or pp.is_last else None
        self.huge_page_bytes = 0  # weight bytes load_weights placed on huge pages (loom/model/huge_pages.py)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata | list[AttentionMetadata],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run every layer over a flattened batch, writing its K/V into the paged caches.

        Args:
            input_ids: [num_tokens] int64, tokens of all requests concatenated (no padding).
            positions: [num_tokens] int64, position of each token in its request.
            kv_caches: num_layers tensors [2, num_blocks, block_size, num_kv_heads, head_dim].
            attn_metadata: where each token's K/V goes and what each request attends to; a list gives each layer
                its own (a hybrid KV cache, loom/core/kv_groups.py).
            intermediate: a later pipeline stage's input, the previous stage's (hidden, residual).

        Returns:
            Final-norm hidden states [num_tokens, hidden_size], model dtype; on a pipeline stage before the last,
            its (hidden, residual) for the next stage.

        Raises:
            ValueError: a position beyond max_position_embeddings.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 (soft-capped where the family does: Gemma 2)."""
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Hand Hugging Face-named checkpoint tensors (dense tensors, or PackedWeight blocks from a GGUF file
        run packed) to the loader of the parameter each belongs to, then let every layer's quant method
        process what it got.

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or parameters left unloaded.
        """
        expected = self._expected_loads()
        loaded: set[tuple[str, str, int | None]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from rope_theta
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # the tied head reads the embedding
            module_name, param, shard = _stacked_target(name)
            if not self._holds(module_name):
                continue  # another pipeline stage's
            key = (module_name, param, shard)
            if key not in expected and (module_name, param, 0) in expected and isinstance(tensor, torch.Tensor) \
                    and tensor.dim() >= 1:
                # a projection the checkpoint stores fused (Phi-3's qkv_proj, gate_up_proj): split it into the
                # shards of our stacked layer, in order
                module = self.get_submodule(module_name)
                if module.shard is not None:
                    raise ValueError(f"{name}: tensor parallelism does not split checkpoints that store this "
                                     "projection fused (Phi-3's Hugging Face files) yet; use its GGUF file")
                sizes = list(module.output_sizes)
                if tensor.shape[0] != sum(sizes):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not split into {sizes}")
                for i, piece in enumerate(tensor.split(sizes, dim=0)):
                    try:
                        module.load(param, piece, i)
                    except ValueError as exc:
                        raise ValueError(f"{name} (shard {i}): {exc}") from exc
                    loaded.add((module_name, param, i))
                continue
            if key not in expected:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            module = self.get_submodule(module_name)
            if isinstance(module, RMSNorm):
                if module.weight.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(module.weight.shape)}")
                if self.arch.norm_weight_offset:  # Gemma scales by (1 + w): add the 1 in float32, as it does
                    tensor = tensor.float() + self.arch.norm_weight_offset
                module.weight.data.copy_(tensor)
            else:
                try:
                    module.load(param, tensor, shard)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from exc
            loaded.add(key)
            if module_name == "model.embed_tokens" and self.lm_head is not None and self.lm_head.tied is not None \
                    and not _shares_table(self.lm_head):
                self.lm_head.load("weight", tensor)  # a tied head that keeps its own (packed) form
        missing = sorted(f"{m}.{p}" + ("" if s is None else f"[{s}]") for m, p, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for parameters: {missing[:8]}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        self._share_interleaved_table()
        self.huge_page_bytes = place_weights_on_huge_pages(self)  # before the decode step records where they are
        self.model.prepare_decode_step()

    def _share_interleaved_table(self) -> None:
        """A tied LM head whose packed matrix was interleaved at load (q4gr16 / q8gr16) holds the embedding's table
        in another order: the embedding then looks its rows up there (PackedWeight.rows gathers them), so the
        matrix is held once."""
        head, embed = self.lm_head, self.model.embed_tokens
        if head is None or embed is None or head.tied is not embed or embed.packed is None or embed.tp is not None:
            return
        parts = getattr(head, "packed", None) or []
        if len(parts) != 1 or INTERLEAVED.get(parts[0].layout) != embed.packed.layout:
            return
        mine = deinterleave_rows16(parts[0])
        same = mine.group_size == embed.packed.group_size and torch.equal(mine.qweight, embed.packed.qweight.to(
            mine.qweight.device)) and torch.equal(mine.scales, embed.packed.scales.to(mine.scales.device))
        if same and (mine.mins is None) == (embed.packed.mins is None) and (
                mine.mins is None or torch.equal(mine.mins, embed.packed.mins.to(mine.mins.device))):
            embed.packed = parts[0]

    def _holds(self, module_name: str) -> bool:
        """False for a module another rank holds: a layer of another pipeline stage, the embedding or the LM head
        off their stages, an expert of another expert-parallel rank."""
        if module_name == "model.embed_tokens":
            return self.model.embed_tokens is not None
        if module_name == "lm_head":
            return self.lm_head is not None
        module: Any = self
        for part in module_name.split("."):
            if isinstance(module, PPMissingLayer):
                return False
            module = getattr(module, part, None)
            if module is None:
                return True  # an unknown name: load_weights names it
        return not isinstance(module, PPMissingLayer)

    def _expected_loads(self) -> set[tuple[str, str, int | None]]:
        """(module name, parameter name, shard or None) of every checkpoint tensor the model needs."""
        expected: set[tuple[str, str, int | None]] = set()
        for module_name, module in self.named_modules():
            if isinstance(module, LMHead) and module.tied is not None:
                continue
            if isinstance(module, Linear):
                stacked = len(module.output_sizes) > 1
                for param in module.weight_loaders:
                    for shard in (range(len(module.output_sizes)) if stacked else [None]):
                        expected.add((module_name, param, shard))
            elif isinstance(module, (RMSNorm, VocabEmbedding)):
                expected.add((module_name, "weight", None))
        return expected

    def weight_report(self) -> dict[str, tuple[str, int]]:
        """Layer type (qkv_proj, o_proj, gate_up_proj, down_proj, embed_tokens, lm_head) -> (formats, bytes
        of one pass over those weights, summed over layers), for the start-up log and the roofline. A tied
        lm_head reports the matrix it reads (the embedding's, or its own packed copy)."""
        report: dict[str, tuple[set[str], int]] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, LMHead) and _shares_table(module):
                fmt, nbytes = module.tied.weight_format()
            elif isinstance(module, (Linear, VocabEmbedding)):
                fmt, nbytes = module.weight_format()
            else:
                continue
            kind = module_name.rsplit(".", 1)[-1]
            formats, total = report.get(kind, (set(), 0))
            report[kind] = (formats | {fmt}, total + nbytes)
        return {k: (", ".join(sorted(f)), n) for k, (f, n) in report.items()}


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding attention window (arch.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (not on o_proj)."""

    def __init__(
        self, arch: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
        quant_config: QuantizationConfig | None = None, *, tp: TensorParallel | None = None,
        pp: PipelineParallel | None = None,
    ) -> None:
        super().__init__(arch, backend, dtype, device, quant_config, o_proj_bias=False, tp=tp, pp=pp)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: post-norm layers (arch.post_norm) and QK-norm over the whole q and k projections."""


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral with a sparse mixture-of-experts FFN in every layer (SparseMoeBlock)."""


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE: Qwen2 with MoE FFNs (no renormalization by default, a sigmoid-gated shared expert)."""


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's per-head QK-norm with MoE FFNs."""


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE: pre-norm layers with QK-norm over the whole projections and MoE FFNs."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama whose checkpoints store q/k/v and gate/up fused (split at load into the stacked layers),
    with a sliding window where configured, and LongRoPE scaling in the 128k-context models."""


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text (Gemma Team 2025, arXiv:2503.19786): sandwich norms with (1 + w) RMSNorm weights, per-head
    QK-norm, GeGLU MLP, embeddings scaled by sqrt(hidden_size), local sliding-window layers (their own rotary
    base) interleaved with global ones (arch.layer_types), softmax scale query_pre_attn_scalar ** -0.5."""


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (Gemma Team 2024, arXiv:2408.00118): Gemma 3's layer without QK-norm, one rotary base, and
    soft-capping of the attention scores and of the final logits (cap * tanh(x / cap))."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): Llama with QK-norm (arch.qk_norm); `attention_bias` puts biases on q/k/v and o_proj alike,
    as in Llama (false in the released models)."""


def _shares_table(head: LMHead) -> bool:
    """True when a tied head reads the embedding's own dense Parameter (nothing to load for it)."""
    return head.weight is not None and head.tied is not None and head.weight is head.tied.weight


def _stacked_target(name: str) -> tuple[str, str, int | None]:
    """Map a checkpoint name to (our module name, parameter name, shard index or None)."""
    parts = [_RENAMED.get(p, p) for p in name.split(".")]
    for i, part in enumerate(parts):
        if part in _STACKED:
            stacked, shard = _STACKED[part]
            return ".".join(parts[:i] + [stacked]), ".".join(parts[i + 1 :]), shard
    return ".".join(parts[:-1]), parts[-1], None
