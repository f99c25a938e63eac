"""Roofline floors for LLM inference: the physical lower bounds a run is measured against.

Formulas (shared/reference/anchors.md section 5; roofline model of Williams, Waterman and Patterson 2009;
"physical limit" = model bytes / BW as tabulated in llama.cpp PR #1642):

  kv_tok            = 2·L·H_kv·d_h·b_kv                               bytes per token of context
  t_decode(B, C)    = max((b·P + B·C·kv_tok) / BW, (2·P·B + 4·L·H·d_h·B·C) / F)   seconds per step
  t_prefill(N)      = max((b·P + N·kv_tok) / BW, (2·P·N + 2·L·H·d_h·N²) / F)       seconds
  (sliding-window layers, Gemma: C in the KV and attention terms is the context a query attends to on average
  over the layers, ((L - L_s)·C + L_s·min(C, W)) / L, and N² / 2 the (query, key) pairs of a causal prefill)
  B_sat(C)          = batch at which the two decode terms meet
                    = b·P·F/BW / (2·P + 4·L·H·d_h·C − C·kv_tok·F/BW);  = R·b/2 at C = 0, R = F/BW
  single stream     = 1 / t_decode(1, C)   tokens/s  (= BW / (b·P + C·kv_tok) while bandwidth-bound)

P counts the parameters read per decoded token (see ModelArch.num_decode_params), b is bytes per weight,
b_kv bytes per KV element, BW the achievable memory bandwidth, F the achievable matmul rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loom.bench.model_arch import ModelArch
from loom.bench.probe import MachineSpec

# bytes per weight for the dtypes loom computes in, plus GGUF block formats (block bytes / 32 weights)
BYTES_PER_WEIGHT: dict[str, float] = {
    "float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0,
    "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32,
}
# nominal bytes per KV element; the quantized formats' rows also carry scales (kv_bytes_per_element)
BYTES_PER_KV_ELEMENT: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0}


def kv_bytes_per_element(kv_dtype: str, head_dim: int, param: str = "kv_dtype") -> float:
    """b_kv as the engine stores it: the float formats' element size; int8 / fp8 (or the engine's name fp8_e4m3)
    with their rows' scales (loom/attention/kv_quant.py: int8 72 bytes per row of 64).

    Raises:
        ValueError: an unknown `kv_dtype` (named as `param`).
    """
    if kv_dtype not in BYTES_PER_KV_ELEMENT and kv_dtype != "fp8_e4m3":
        raise ValueError(f"{param} must be one of {(*BYTES_PER_KV_ELEMENT, 'fp8_e4m3')}, got {kv_dtype!r}")
    kv_dtype = "fp8" if kv_dtype == "fp8_e4m3" else kv_dtype
    nominal = BYTES_PER_KV_ELEMENT[kv_dtype]
    if kv_dtype not in ("int8", "fp8"):
        return nominal
    import torch

    from loom.attention.kv_quant import kv_row_bytes

    return kv_row_bytes(head_dim, torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn) / head_dim


def _lookup(table: dict[str, float], name: str, param: str) -> float:
    if name not in table:
        raise ValueError(f"{param} must be one of {tuple(table)}, got {name!r}")
    return table[name]


@dataclass(frozen=True, slots=True)
class Roofline:
    """A model in a dtype on a machine. Construct, then ask it for floors."""

    arch: ModelArch  # model shape
    machine: MachineSpec  # BW and F
    weight_bytes_per_param: float  # b, bytes per weight
    kv_bytes_per_element: float  # b_kv, bytes per cached K or V element

    @classmethod
    def build(cls, arch: ModelArch, machine: MachineSpec, weight_dtype: str, kv_dtype: str) -> "Roofline":
        """Raises ValueError naming `weight_dtype` or `kv_dtype` when unknown."""
        return cls(arch, machine, _lookup(BYTES_PER_WEIGHT, weight_dtype, "weight_dtype"),
                   kv_bytes_per_element(kv_dtype, arch.head_dim))

    @property
    def num_params(self) -> int:
        """P, parameters in the checkpoint."""
        return self.arch.num_params

    @property
    def weight_bytes(self) -> float:
        """b·P for the parameters read per decode step, bytes."""
        return self.arch.num_decode_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """kv_tok = 2·L·H_kv·d_h·b_kv, bytes (K and V, every layer)."""
        a = self.arch
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.kv_bytes_per_element

    def kv_capacity_tokens(self, budget_bytes: float, block_size: int = 1) -> int:
        """Tokens of KV that fit in `budget_bytes`: ⌊budget / (block_size·kv_tok)⌋·block_size."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return math.floor(budget_bytes / (block_size * self.kv_bytes_per_token)) * block_size

    def _attn_flops_per_token_ctx(self) -> float:
        # QKᵀ and A·V each cost 2·H·d_h FLOP per (query token, context token) per layer
        a = self.arch
        return 4 * a.num_layers * a.num_heads * a.head_dim

    def decode_bytes(self, batch: int, context: int) -> float:
        """Bytes moved per decode step: b·P + B·C·kv_tok."""
        _check_positive(batch=batch)
        _check_nonnegative(context=context)
        return self.weight_bytes + batch * self.arch.attended_context(context) * self.kv_bytes_per_token

    def decode_flops(self, batch: int, context: int) -> float:
        """FLOP per decode step: 2·P·B + 4·L·H·d_h·B·C."""
        _check_positive(batch=batch)
        _check_nonnegative(context=context)
        p = self.arch.num_decode_params
        return 2 * p * batch + self._attn_flops_per_token_ctx() * batch * self.arch.attended_context(context)

    def decode_step_floor(self, batch: int, context: int) -> float:
        """t_decode(B, C) = max(bytes/BW, FLOP/F), seconds per step of B sequences at context C."""
        return max(self.decode_bytes(batch, context) / self.machine.bandwidth,
                   self.decode_flops(batch, context) / self.machine.flops)

    def decode_bound(self, batch: int, context: int) -> str:
        """"memory" or "compute": which term sets decode_step_floor."""
        mem = self.decode_bytes(batch, context) / self.machine.bandwidth
        return "memory" if mem >= self.decode_flops(batch, context) / self.machine.flops else "compute"

    def prefill_floor(self, num_tokens: int) -> float:
        """t_prefill(N) = max((b·P + N·kv_tok)/BW, (2·P·N + 2·L·H·d_h·N²)/F), seconds (causal attention)."""
        _check_positive(num_tokens=num_tokens)
        n = num_tokens
        mem = (self.weight_bytes + n * self.kv_bytes_per_token) / self.machine.bandwidth
        flops = 2 * self.arch.num_decode_params * n + self._attn_flops_per_token_ctx() * self.arch.attended_pairs(n)
        return max(mem, flops / self.machine.flops)

    def saturation_batch(self, context: int = 0) -> float:
        """B_sat(C): smallest batch at which decode turns compute-bound; inf if it never does."""
        _check_nonnegative(context=context)
        ridge = self.machine.ridge
        attended = self.arch.attended_context(context)
        denom = (2 * self.arch.num_decode_params + self._attn_flops_per_token_ctx() * attended
                 - attended * self.kv_bytes_per_token * ridge)
        if denom <= 0:
            return math.inf
        return self.weight_bytes * ridge / denom

    def single_stream_ceiling(self, context: int = 0) -> float:
        """Most tokens/s one sequence can decode at context C: 1 / t_decode(1, C)."""
        return 1.0 / self.decode_step_floor(1, context)

    def decode_throughput_ceiling(self, batch: int, context: int) -> float:
        """Most output tokens/s for B sequences at context C: B / t_decode(B, C)."""
        return batch / self.decode_step_floor(batch, context)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def _check_nonnegative(**values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
