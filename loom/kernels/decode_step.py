"""ctypes binding of csrc/decode_step.c: a whole decode step of a packed Llama-family model in one C call.

`DecodeStep.prepare(model)` checks that the model's layers are what the C step runs (every projection
packed with float activations, or W8A8's int8 activations per token, shards of different layouts as a chain of
parts; bf16 or FP8 weights under float32 activations; the fused ops and paged
decode kernels of the same library; the cpu_paged backend) and records the weight pointers once; `run(...)`
serves a pure decode step (every token a request's single new token) of at most `max_rows` requests over
KV caches of the model dtype, of a 16-bit float type (bfloat16, float16) or of int8 rows (`_KV_TYPES`), and
returns None for anything else (fp8 caches), so the per-layer path stays the fallback. Same
kernels in the same order as the per-layer path (loom/model/llama.py), so its hidden states equal that path's
bit for bit (tests/kernels/test_decode_step.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loom.kernels.cpu_generic import _torch_chunk, _torch_lanes

_DTYPE_FLAGS = {torch.float32: 0, torch.bfloat16: 1}
# the C step's kv_type for caches not of the model dtype (int8: loom/attention/kv_quant.py's rows)
_KV_TYPES = {torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


class _Packed(ctypes.Structure):
    pass


_Packed._fields_ = [("qweight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                    ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                    ("group", ctypes.c_int64), ("kind", ctypes.c_int64), ("next", ctypes.POINTER(_Packed)),
                    ("rot", ctypes.c_int64), ("act_scale", ctypes.c_float)]
# LoomPacked.kind of each weight layout the step reads (bf16: a bf16 checkpoint's weights, float32 models only;
# q8g_int8: q8g under per-token int8 activations, W8A8, float32 models only; fp8: e4m3 weights and a float32
# scale per row, float32 models only)
_KINDS = {"q4g": 0, "q8g": 1, "bf16": 2, "q8g_int8": 3, "q4gr16": 4, "q8gr16": 5, "fp8": 6}


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Packed), ("o", _Packed), ("gate_up", _Packed), ("down", _Packed),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_attn_norm", ctypes.c_void_p), ("post_ffw_norm", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("local_rope", ctypes.c_int64), ("block_table", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("bt_stride", ctypes.c_int64), ("summaries", ctypes.c_void_p), ("summary_valid", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("is_bf16", ctypes.c_int), ("torch_lanes", ctypes.c_int), ("num_threads", ctypes.c_int),
                ("kv_type", ctypes.c_int), ("act", ctypes.c_int), ("sparse_topk", ctypes.c_int64),
                ("sparse_sink", ctypes.c_int64), ("sparse_recent", ctypes.c_int64), ("num_blocks", ctypes.c_int64)]

_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}  # LoomDims.act


class DecodeStep:
    """The compiled decode step (one library per ISA: decode_step.c with qgemm.c, gemv_w16.c, gemv_fp8.c,
    fused_ops.c, paged_decode.c)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        fn = lib.loom_decode_step
        fn.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                       + [ctypes.c_void_p] * 10 + [ctypes.c_int64] + [ctypes.c_void_p] * 2)
        fn.restype = ctypes.c_int
        self._fn = fn
        self.isa = isa


class ModelDecodeStep:
    """A DecodeStep bound to one loaded model (weights recorded once)."""

    def __init__(self, kernel: DecodeStep, model: torch.nn.Module, max_rows: int) -> None:
        """model: a loom LlamaModel whose layers `supports_model` accepted; max_rows: most requests per step
        (at most BF16_GEMV_MAX_ROWS with bf16 weights and FP8_GEMV_MAX_ROWS with fp8 ones, where the per-layer
        path leaves the GEMV kernel)."""
        from loom.quant.methods import BF16_GEMV_MAX_ROWS, FP8_GEMV_MAX_ROWS, Bf16WeightMethod, Fp8LinearMethod

        self.kernel = kernel
        layer0 = model.layers[0]
        attn = layer0.self_attn
        self.dtype = model.norm.weight.dtype
        self.backend = attn.attn.backend
        # block-sparse decode attention (loom/attention/sparse.py): the backend's selector, whose per-layer key
        # summaries the C step widens and reads; None = dense
        self.sparse: Any = getattr(self.backend, "sparse", None)
        self.sliding_window = attn.attn.sliding_window
        self.dims = _Dims(len(model.layers), model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
                          attn.head_dim, layer0.mlp.down_proj.input_size, 0, layer0.input_layernorm.eps,
                          attn.attn.scale, _DTYPE_FLAGS[self.dtype], _torch_lanes(), 1, 0, _ACTS[layer0.mlp.act])
        self.layers = (_Layer * len(model.layers))()
        self._parts: list[_Packed] = []  # the chained parts of mixed-layout projections (kept alive here)
        for entry, layer in zip(self.layers, model.layers, strict=True):
            a, m = layer.self_attn, layer.mlp
            for name, lin in (("qkv", a.qkv_proj), ("o", a.o_proj), ("gate_up", m.gate_up_proj), ("down", m.down_proj)):
                setattr(entry, name, self._chain(lin))
                if isinstance(lin.quant_method, Bf16WeightMethod):
                    max_rows = min(max_rows, BF16_GEMV_MAX_ROWS)
                elif isinstance(lin.quant_method, Fp8LinearMethod):
                    max_rows = min(max_rows, FP8_GEMV_MAX_ROWS)
            entry.norm1 = layer.input_layernorm.weight.data_ptr()
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's sandwich: two norms more
                entry.norm2 = layer.pre_feedforward_layernorm.weight.data_ptr()
                entry.post_attn_norm = layer.post_attention_layernorm.weight.data_ptr()
                entry.post_ffw_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            else:
                entry.norm2 = layer.post_attention_layernorm.weight.data_ptr()
            if a.q_norm is not None:  # QK-norm (Qwen3, Gemma 3)
                entry.q_norm, entry.k_norm = a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr()
            entry.window = a.attn.sliding_window or 0
            entry.local_rope = int(a.local_rope)
        self.max_rows = max_rows
        self.final_norm = model.norm.weight
        self._keep = model  # the recorded pointers stay valid while the model lives
        self._caches_id: int | None = None
        self._scratch: dict[int, list[torch.Tensor]] = {}
        self._per_layer_tables = False  # the layers' own block tables are set (a hybrid KV cache's last step)
        self._tables_alive: dict[int, torch.Tensor] = {}  # the tensors those pointers point into

    def run(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
            attn_metadata: Any, cos_sin_local: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """hidden [B, hidden_size] (the embedding rows, scaled where the family scales them), cos_sin from
        RotaryEmbedding.cos_sin (cos_sin_local: the local rotary's, for Gemma 3's sliding layers) -> final-norm
        hidden states [B, hidden_size], or None when this step is not a pure decode step it serves. attn_metadata: one
        for every layer, or each layer's (a hybrid KV cache: one block table and slot mapping per group of layers)."""
        metas = attn_metadata if isinstance(attn_metadata, list) else None
        if metas is not None:
            attn_metadata = metas[0]
        batch = hidden.shape[0]
        if batch == 0 or batch > self.max_rows or attn_metadata.num_tokens != batch:
            return None
        cache0 = kv_caches[0]
        if (cache0.dtype != self.dtype and cache0.dtype not in _KV_TYPES) or not cache0.is_contiguous() \
                or hidden.dtype != self.dtype:
            return None
        if attn_metadata.max_query_len == 1 and attn_metadata.num_reqs == batch:
            plan = self.backend._step_plan(attn_metadata, self.sliding_window, self.dtype)
            decode = plan.decode
            if decode is None or decode.token_rows is not None or plan.prefills:
                return None
            table, seq_lens = decode.block_ids, decode.seq_lens
        else:
            # a step with multi-token queries (a speculative verify step, a short prefill chunk): every row as a
            # decode row of its request, over its own causal prefix, as the per-layer path runs such rows
            # (CpuPagedBackend: rows of up to PER_ROW_MAX_KEYS keys through the decode kernel), so the results
            # are the same bits; the rows' K/V are all written before any row attends (decode_step.c)
            rows = self._rows_as_decode(attn_metadata, metas)
            if rows is None:
                return None
            table, seq_lens = rows
        if metas is not None:  # each layer reads and writes through its group's table
            tables: dict[int, torch.Tensor] = {}  # metadata id -> its decode block ids, alive through the call
            for entry, meta in zip(self.layers, metas, strict=True):
                table_l = tables.get(id(meta))
                if table_l is None:
                    table_l = tables[id(meta)] = self.backend._step_plan(meta, self.sliding_window,
                                                                         self.dtype).decode.block_ids
                entry.block_table, entry.bt_stride = table_l.data_ptr(), table_l.stride(0)
                entry.slot_mapping = meta.slot_mapping.data_ptr()
            self._per_layer_tables = True
            self._tables_alive = tables
        elif self._per_layer_tables:
            for entry in self.layers:
                entry.block_table = entry.slot_mapping = None
            self._per_layer_tables = False
        if id(kv_caches) != self._caches_id:
            for entry, cache in zip(self.layers, kv_caches, strict=True):
                entry.k_cache, entry.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
                if self.sparse is not None:
                    summaries, valid = self.sparse.summaries(cache)
                    entry.summaries, entry.summary_valid = summaries.data_ptr(), valid.data_ptr()
            if self.sparse is not None:
                config = self.sparse.config
                self.dims.sparse_topk, self.dims.sparse_sink = config.topk, config.sink_blocks
                self.dims.sparse_recent, self.dims.num_blocks = config.recent_blocks, cache0.shape[1]
            self.dims.block_size = cache0.shape[2]
            self.dims.kv_type = 0 if cache0.dtype == self.dtype else _KV_TYPES[cache0.dtype]
            self._caches_id = id(kv_caches)
        self.dims.num_threads = torch.get_num_threads()
        scratch = self._scratch.get(batch)
        if scratch is None:
            scratch = self._scratch[batch] = self._alloc(batch)
        residual, normed, h, qkv, q, k, attn, gate_up, act, out = scratch
        cos, sin = cos_sin
        cos_local, sin_local = cos_sin_local if cos_sin_local is not None else cos_sin
        hidden = hidden.contiguous()
        slots = attn_metadata.slot_mapping
        for forced in (False, True):
            if self.sparse is not None:  # the stale summaries the selection will read, recomputed first
                # (the rows before this step's: the step writes its own keys and widens the summaries itself);
                # after a refused step every layer is checked, and the step runs again: it only rewrites the same
                # K/V rows and widens the summaries with the same keys, so a rerun gives the same result
                self.sparse.refresh_stale(kv_caches, table, seq_lens - 1, force=forced)
            rc = self.kernel._fn(ctypes.byref(self.dims), self.layers, self.final_norm.data_ptr(), hidden.data_ptr(),
                                 cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), table.data_ptr(), table.stride(0),
                                 seq_lens.data_ptr(), batch, out.data_ptr(), residual.data_ptr(),
                                 normed.data_ptr(), h.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr(),
                                 attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
                                 _torch_chunk(batch * self.dims.inter), cos_local.data_ptr(), sin_local.data_ptr())
            if rc != -2 or self.sparse is None:
                break
        if rc == -2:
            raise RuntimeError("loom_decode_step found a stale key summary (block-sparse attention)")
        if rc != 0:
            raise MemoryError("loom_decode_step could not allocate its scratch memory")
        return out.clone()  # the scratch is reused by the next step

    def _rows_as_decode(self, attn_metadata: Any, metas: list | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block table [T, max_blocks] int64, seq_lens [T] int64) of a step's T rows, each a decode row over its
        request's keys up to and including its own position; None where the per-layer path would not run every row
        through the decode kernel (contexts over PER_ROW_MAX_KEYS, block-sparse decode, per-layer tables, no
        kernel for this query and cache)."""
        from loom.attention.cpu_paged import PER_ROW_MAX_KEYS

        if metas is not None or self.sparse is not None or max(attn_metadata.seq_lens_cpu) > PER_ROW_MAX_KEYS:
            return None
        starts = attn_metadata.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(attn_metadata.num_reqs)]
        lens = [seq - q + 1 + j for seq, q in zip(attn_metadata.seq_lens_cpu, q_lens, strict=True) for j in range(q)]
        owner = torch.repeat_interleave(torch.arange(attn_metadata.num_reqs), torch.tensor(q_lens))
        max_blocks = -(-max(attn_metadata.seq_lens_cpu) // attn_metadata.block_size)
        table = attn_metadata.block_tables[:, :max_blocks].long().index_select(0, owner)
        return table, torch.tensor(lens, dtype=torch.int64)

    def _chain(self, layer: Any) -> _Packed:
        """The weight of one projection: its bf16 or fp8 matrix, or its packed shards as a chain of parts
        (different layouts)."""
        from loom.quant.methods import Bf16WeightMethod, Fp8LinearMethod

        bias = 0 if layer.bias is None else layer.bias.data_ptr()
        if isinstance(layer.quant_method, Bf16WeightMethod):
            n, k = layer.weight.shape
            return _Packed(layer.weight.data_ptr(), 0, 0, bias, n, k, 0, _KINDS["bf16"])
        if isinstance(layer.quant_method, Fp8LinearMethod):
            n, k = layer.fp8_weight.shape
            return _Packed(layer.fp8_weight.data_ptr(), layer.fp8_scale.data_ptr(), 0, bias, n, k, 0, _KINDS["fp8"])
        parts = [_packed(p, b) for p, b in zip(layer.packed, layer.packed_bias, strict=True)]
        activations = layer.quant_method.scheme.activations
        if activations in ("q8_token", "q8_static"):  # W8A8: int8 activations, rotated or not
            for part in parts:
                part.kind, part.rot = _KINDS["q8g_int8"], layer.rotation_block
                part.act_scale = layer.input_scale if activations == "q8_static" else 0.0
        for part, following in zip(parts, parts[1:], strict=False):
            part.next = ctypes.pointer(following)
        self._parts.extend(parts[1:])
        return parts[0]

    def _alloc(self, batch: int) -> list[torch.Tensor]:
        d = self.dims
        widths = [d.hidden, d.hidden, d.hidden, (d.heads + 2 * d.kv_heads) * d.head_dim, d.heads * d.head_dim,
                  d.kv_heads * d.head_dim, d.heads * d.head_dim, 2 * d.inter, d.inter, d.hidden]
        return [torch.empty(batch, w, dtype=self.dtype) for w in widths]


def _packed(p: Any, bias: torch.Tensor | None) -> _Packed:
    n, k = p.shape
    return _Packed(p.qweight.data_ptr(), p.scales.data_ptr(), 0 if p.mins is None else p.mins.data_ptr(),
                   0 if bias is None else bias.data_ptr(), n, k, p.group_size, _KINDS[p.layout])


def supports_model(model: torch.nn.Module) -> bool:
    """True when every decoder layer of a loom LlamaModel is what the C step runs: packed weights (shards of
    different layouts as a chain) with float activations, W8A8 (q8g weights, int8 activations per token after the
    optional Hadamard rotation, or with a checkpoint's static scale and per-channel weights; float32 models), or
    bf16 weights (`--quantization bf16`) under float32 activations with loom's gemv_w16 kernel, or FP8 weights
    (`--quantization fp8`) with its gemv_fp8 kernel; loom's fused ops, cpu_paged attention, float32 or bfloat16;
    per-head QK-norm (Qwen3, Gemma 3) and Gemma's sandwich norms, GeGLU and per-layer windows and rotary
    bases included; post-norm layers (OLMo 2), MoE FFNs and soft-capped attention (Gemma 2) not."""
    from loom.attention.cpu_paged import CpuPagedBackend
    from loom.quant.methods import Bf16WeightMethod, Fp8LinearMethod, PackedLinearMethod

    if model.norm.weight.dtype not in _DTYPE_FLAGS or model.norm.weight.device.type != "cpu":
        return False
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        if not hasattr(layer, "input_layernorm") or not hasattr(m, "gate_up_proj"):
            return False  # post-norm layers (OLMo 2), mixture-of-experts FFNs: the per-layer path
        if a.attn.logit_softcapping is not None or m.act != model.layers[0].mlp.act:
            return False  # Gemma 2's soft-capped attention scores: the per-layer path
        if not isinstance(a.attn.backend, CpuPagedBackend) or a.kernels is None or m.kernels is None \
                or layer.input_layernorm.kernels is None or a.attn.backend.decode_kernel is None:
            return False
        if not a.attn.backend.float32_kernels and model.norm.weight.dtype == torch.float32:
            return False
        if a.q_norm is not None and (a.qk_norm != "per_head" or a.q_norm.kernels is None or a.k_norm.kernels is None):
            return False  # per-head QK-norm runs loom's fused RMSNorm in both paths, else the per-layer path alone
        for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
            method = getattr(lin, "quant_method", None)
            if isinstance(method, Bf16WeightMethod):  # the gemv_w16 kernel the per-layer path runs, float32 x
                if method.gemv is None or model.norm.weight.dtype != torch.float32 or not lin.weight.is_contiguous() \
                        or (lin.bias is not None and lin.bias.dtype != torch.float32):
                    return False
                continue
            if isinstance(method, Fp8LinearMethod):  # the gemv_fp8 kernel the per-layer path runs, float32 x
                if lin.fp8_kernel is None or model.norm.weight.dtype != torch.float32 \
                        or (lin.bias is not None and lin.bias.dtype != torch.float32):
                    return False
                continue
            if not isinstance(method, PackedLinearMethod) or lin.dense_weight is not None \
                    or lin.input_perm is not None:
                return False
            if method.scheme.activations in ("q8_token", "q8_static"):  # W8A8 (torch's int8 GEMM: the same bits)
                if model.norm.weight.dtype != torch.float32 or not all(p.layout == "q8g" for p in lin.packed) \
                        or (method.scheme.activations == "q8_static" and not lin.int_gemm):
                    return False  # a static scale with per-group weights: the per-layer path
            elif method.scheme.activations != "float":
                return False
    return True
