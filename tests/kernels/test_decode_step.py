"""loom's one-call C decode step (loom/kernels/decode_step.py) against the per-layer path on the real model:
the same kernels in the same order, so hidden states and the KV rows it writes are equal bit for bit."""

from __future__ import annotations

import pytest
import torch

from loom.attention import build_attention_metadata
from loom.attention.kv_quant import dequantize_rows
from loom.kernels.registry import get_kernel, kernel_isas
from loom.model.loader import load_model
from loom.worker.kv_cache import allocate_kv_caches

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def packed_model():
    loaded = load_model(None, torch.float32, CPU, quantization="gguf")
    if loaded.model.model.decode_step is None:
        pytest.skip("the decode step does not build here (no compiler)")
    return loaded


def _prefill(model, arch, prompts, block_size=16, kv_dtype=torch.float32):
    caches = allocate_kv_caches(arch, 32, block_size, kv_dtype, CPU)
    tables = [[3 + 7 * i + j for j in range(4)] for i in range(len(prompts))]  # scattered, disjoint blocks
    for prompt, table in zip(prompts, tables):
        meta = build_attention_metadata([len(prompt)], [len(prompt)], [table], block_size, CPU)
        model(torch.tensor(prompt), torch.arange(len(prompt)), caches, meta)
    return caches, tables


def _both_paths(model, arch, step, prompts, kv_dtype=torch.float32, q_lens=None, served=None):
    """One step after `prompts` (each request `q_lens` query tokens, default 1: a decode step), by the per-layer
    path and then by `step` from the same caches: (per-layer hidden, its caches, one-call hidden, its caches). With
    `served` (a list), what each step.run call returned is appended to it. The model's own decode step is restored."""
    inner = model.model
    q_lens = q_lens or [1] * len(prompts)
    with torch.inference_mode():
        caches, tables = _prefill(model, arch, prompts, kv_dtype=kv_dtype)
        lens = [len(p) + q for p, q in zip(prompts, q_lens)]
        meta = build_attention_metadata(q_lens, lens, tables, 16, CPU)
        ids = 42 + torch.arange(sum(q_lens))
        pos = torch.tensor([n - q + j for n, q in zip(lens, q_lens) for j in range(q)])
        saved = [c.clone() for c in caches]
        inner.decode_step = None
        per_layer = model(ids, pos, caches, meta)
        per_layer_caches = [c.clone() for c in caches]
        for c, s in zip(caches, saved):
            c.copy_(s)
        inner.decode_step = step
        if served is not None:
            run = step.run
            step.run = lambda *a, **k: served.append(run(*a, **k)) or served[-1]
        try:
            one_call = model(ids, pos, caches, meta)
        finally:
            step.__dict__.pop("run", None)
            inner.prepare_decode_step()
    return per_layer, per_layer_caches, one_call, caches


def _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, tol) -> None:
    """Bit for bit on the best ISA (the per-layer path runs its kernels too), else within relative `tol`."""
    if isa == kernel_isas("decode_step")[0]:
        assert torch.equal(one_call, per_layer)
        assert all(torch.equal(a, b) for a, b in zip(caches, per_layer_caches))
    else:
        assert float((one_call - per_layer).norm() / per_layer.norm()) < tol


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_decode_step_equals_the_per_layer_path(packed_model, isa: str, kv_dtype: torch.dtype) -> None:
    """Also over 16-bit and int8 caches under the float32 model: the step rounds (quantizes) the K/V rows it
    writes as torch's copy into the cache (kv_quant.quantize_rows) does, and attends over them with the
    per-layer path's kernel."""
    from loom.kernels.decode_step import ModelDecodeStep

    model, arch = packed_model.model, packed_model.arch
    inner = model.model
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    per_layer, per_layer_caches, one_call, caches = _both_paths(
        model, arch, step, [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17], kv_dtype)
    assert all(c.dtype == kv_dtype for c in caches)
    if isa == kernel_isas("decode_step")[0]:  # the per-layer path runs the best ISA's kernels too
        assert torch.equal(one_call, per_layer)
        assert all(torch.equal(a, b) for a, b in zip(caches, per_layer_caches))
    else:  # another ISA's kernels sum in another order: float32 rounding apart, which can move an int16
        # activation code by one step (2^-15 of its block's max) in a later layer: relative error, 30 layers
        # (over a 16-bit cache such a difference can also move a K/V value to the neighbouring 16-bit number)
        tol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.int8: 2e-2}[kv_dtype]
        rel = float((one_call - per_layer).norm() / per_layer.norm())
        assert rel < tol, rel
        for a, b in zip(caches, per_layer_caches):
            if kv_dtype == torch.int8:  # compare the values the rows hold, not their code and metadata bytes
                a, b = dequantize_rows(a, torch.float32), dequantize_rows(b, torch.float32)
            a, b = a.float(), b.float()
            assert float((a - b).norm() / b.norm()) < tol


def test_decode_step_declines_what_it_does_not_serve(packed_model) -> None:
    inner = packed_model.model.model
    step = inner.decode_step
    caches = allocate_kv_caches(packed_model.arch, 8, 16, torch.float32, CPU)
    hidden = torch.zeros(2, 576)
    cos_sin = inner.rotary_emb.cos_sin(torch.tensor([3, 4]))
    from loom.attention.cpu_paged import PER_ROW_MAX_KEYS

    table = [[0] * (PER_ROW_MAX_KEYS // 16 + 1)]
    long = build_attention_metadata([2], [PER_ROW_MAX_KEYS + 1], table, 16, CPU)  # rows the per-layer path gives
    assert step.run(hidden, cos_sin, caches, long) is None  # to SDPA
    decode = build_attention_metadata([1, 1], [4, 5], [[0], [1]], 16, CPU)
    assert step.run(hidden.bfloat16(), cos_sin, caches, decode) is None  # dtype of the model only
    rows = step.max_rows + 1
    big = build_attention_metadata([1] * rows, [2] * rows, [[i % 8] for i in range(rows)], 16, CPU)
    assert step.run(torch.zeros(rows, 576), inner.rotary_emb.cos_sin(torch.ones(rows, dtype=torch.int64)), caches,
                    big) is None  # more rows than it takes


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_multi_token_rows_run_as_decode_rows_bit_for_bit(packed_model, kv_dtype: torch.dtype) -> None:
    """A step with multi-token queries (a speculative verify step of 4 rows, a decode row, a 3-token chunk) runs in
    the one-call step, each row as a decode row over its own causal prefix: hidden states and the K/V rows equal the
    per-layer path's bit for bit (where the prefill rows go through the same decode kernel)."""
    served: list = []
    per_layer, per_layer_caches, one_call, caches = _both_paths(
        packed_model.model, packed_model.arch, packed_model.model.model.decode_step,
        [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17], kv_dtype, q_lens=[4, 1, 3], served=served)
    assert served and served[0] is not None  # the step served it
    assert torch.equal(one_call, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(caches, per_layer_caches))


@pytest.mark.parametrize("value", ["off", "false", "NO"])
def test_decode_step_switches_take_every_off_word(packed_model, monkeypatch, value: str) -> None:
    """LOOM_DECODE_STEP, and under block-sparse decode attention LOOM_SPARSE_DECODE_STEP, keep the per-layer path for
    any off word (only exactly "0" used to: "off" left the C step on, silently)."""
    inner = packed_model.model.model
    try:
        monkeypatch.setenv("LOOM_DECODE_STEP", value)
        inner.prepare_decode_step()
        assert inner.decode_step is None
        monkeypatch.delenv("LOOM_DECODE_STEP")
        # the switch asks only whether the backend decodes block-sparse: a stand-in selector is enough
        monkeypatch.setattr(inner.layers[0].self_attn.attn.backend, "sparse", object())
        monkeypatch.setenv("LOOM_SPARSE_DECODE_STEP", value)
        inner.prepare_decode_step()
        assert inner.decode_step is None
    finally:
        monkeypatch.undo()
        inner.prepare_decode_step()
    assert inner.decode_step is not None


@pytest.mark.parametrize("name", ["LOOM_DECODE_STEP", "LOOM_SPARSE_DECODE_STEP"])
def test_a_decode_step_switch_that_is_no_on_off_value_is_an_error(packed_model, monkeypatch, name: str) -> None:
    inner = packed_model.model.model
    try:
        monkeypatch.setattr(inner.layers[0].self_attn.attn.backend, "sparse", object())
        monkeypatch.setenv(name, "per-layer")
        with pytest.raises(ValueError, match=f"{name}='per-layer'"):
            inner.prepare_decode_step()
    finally:
        monkeypatch.undo()
        inner.prepare_decode_step()


def test_the_oracle_path_never_takes_the_decode_step() -> None:
    loaded = load_model(None, torch.float32, CPU, quantization="none")
    assert loaded.model.model.decode_step is None


@pytest.mark.parametrize("batch", [1, 3])
def test_mixed_layout_shards_run_as_a_chain_of_parts(batch: int) -> None:
    """A projection whose shards have different layouts (GGUF files that store v as Q6_K and q, k as Q4_K:
    Qwen2.5-Coder-1.5B) is a chain of parts in the C step, each writing its own output columns; the step
    still equals the per-layer path (which concatenates the parts' outputs) bit for bit, at M = 1 (written in
    place) and M > 1 (computed apart, then copied)."""
    from loom.quant.layout import PackedWeight
    from loom.quant.methods import quantize_for_scheme

    loaded = load_model(None, torch.float32, CPU, quantization="gguf")
    model, arch = loaded.model, loaded.arch
    inner = model.model
    if inner.decode_step is None:
        pytest.skip("the decode step does not build here (no compiler)")
    qkv = inner.layers[0].self_attn.qkv_proj
    (whole,) = qkv.packed
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim

    def rows(lo: int, hi: int) -> PackedWeight:
        return PackedWeight(whole.layout, whole.qweight[lo:hi].contiguous(), whole.scales[lo:hi].contiguous(),
                            whole.mins[lo:hi].contiguous(), whole.group_size)

    dense_k = qkv.quant_method.kernels.dequantize(rows(q_rows, q_rows + kv_rows), torch.float32)
    qkv.packed = [rows(0, q_rows), quantize_for_scheme("w8a16", dense_k), rows(q_rows + kv_rows, q_rows + 2 * kv_rows)]
    assert {p.layout for p in qkv.packed} in ({"q4g", "q8g"}, {"q4gr16", "q8g"})  # interleaved where VNNI
    qkv.packed_bias = [None, None, None]
    inner.prepare_decode_step()
    step = inner.decode_step
    assert step is not None  # mixed layouts no longer send the model to the per-layer path
    per_layer, per_layer_caches, one_call, caches = _both_paths(
        model, arch, step, [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17][:batch])
    assert torch.equal(one_call, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(caches, per_layer_caches))


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_qk_norm(tmp_path, isa: str) -> None:
    """A Qwen3-shaped model (QK-norm, head_dim 32 != hidden / heads) packed as w8a16: the one-call step norms
    each q and k head with the per-layer path's kernel, so the two agree bit for bit on the best ISA."""
    from transformers import Qwen3Config

    from loom.kernels.decode_step import ModelDecodeStep
    from tests.model.model_harness import save_tiny_model

    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    save_tiny_model(config, tmp_path, seed=5)
    loaded = load_model(str(tmp_path), torch.float32, CPU, quantization="w8a16")
    model, inner = loaded.model, loaded.model.model
    if get_kernel("decode_step") is None:
        pytest.skip("the decode step does not build here (no compiler)")
    assert inner.layers[0].self_attn.q_norm is not None and inner.decode_step is not None  # the model takes it
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step,
                                                                [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 1e-4)
    # and the step is not the same without the norms: a step that skipped them would differ by far more
    saved = [(e.q_norm, e.k_norm) for e in step.layers]
    for e in step.layers:
        e.q_norm = e.k_norm = None
    _, _, no_norm, _ = _both_paths(model, loaded.arch, step, [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    for e, (qn, kn) in zip(step.layers, saved):
        e.q_norm, e.k_norm = qn, kn
    assert float((no_norm - per_layer).norm() / per_layer.norm()) > 1e-2


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_gemma3_layers(tmp_path, isa: str) -> None:
    """A Gemma 3-shaped model packed as w8a16 — sandwich norms, GeGLU, per-head QK-norm, a sliding layer (window 8,
    local rotary base) then a global one, prompts longer than the window: the one-call step equals the per-layer
    path bit for bit on the best ISA; and each Gemma piece it runs matters (dropping one changes the result)."""
    from transformers import Gemma3TextConfig

    from loom.kernels.decode_step import ModelDecodeStep
    from tests.model.model_harness import save_tiny_model

    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              query_pre_attn_scalar=24, pad_token_id=0)
    save_tiny_model(config, tmp_path, seed=6)
    loaded = load_model(str(tmp_path), torch.float32, CPU, quantization="w8a16")
    model, inner = loaded.model, loaded.model.model
    if get_kernel("decode_step") is None:
        pytest.skip("the decode step does not build here (no compiler)")
    assert inner.decode_step is not None  # the model takes it
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    assert [e.window for e in step.layers] == [8, 0] and [e.local_rope for e in step.layers] == [1, 0]
    prompts = [[1, 2, 3, 4, 5], [9, 10] * 10, [7, 8, 11] * 6]
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step, prompts)
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 1e-4)
    for field, value in (("window", 0), ("local_rope", 0), ("post_attn_norm", None), ("post_ffw_norm", None)):
        saved = getattr(step.layers[0], field)
        setattr(step.layers[0], field, value)
        _, _, changed, _ = _both_paths(model, loaded.arch, step, prompts)
        setattr(step.layers[0], field, saved)
        assert float((changed - per_layer).norm() / per_layer.norm()) > 1e-3, field


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_bf16_weights(tmp_path, isa: str) -> None:
    """A bf16 checkpoint under `--quantization bf16` and float32 activations (a Qwen2-shaped model: q/k/v biases,
    a down projection whose 100 inputs leave a tail past the kernel's 16-wide steps): the one-call step reads the
    bfloat16 weights with the per-layer path's gemv_w16 kernel, so the two agree bit for bit on the best ISA, and
    it serves no more rows than the per-layer path runs that kernel for."""
    from transformers import Qwen2Config

    from loom.kernels.decode_step import ModelDecodeStep
    from loom.quant.methods import BF16_GEMV_MAX_ROWS, Bf16WeightMethod
    from tests.model.model_harness import save_tiny_model

    config = Qwen2Config(vocab_size=96, hidden_size=80, intermediate_size=100, num_hidden_layers=2,
                         num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=128)
    save_tiny_model(config, tmp_path, seed=7, safe_serialization=True)
    loaded = load_model(str(tmp_path), torch.float32, CPU, quantization="bf16")
    model, inner = loaded.model, loaded.model.model
    if get_kernel("decode_step") is None or get_kernel("gemv_w16") is None:
        pytest.skip("the kernels do not build here (no compiler)")
    qkv = inner.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Bf16WeightMethod) and qkv.weight.dtype == torch.bfloat16
    assert qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)  # the biases reach the step
    assert inner.decode_step is not None and inner.decode_step.max_rows == BF16_GEMV_MAX_ROWS
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    assert step.max_rows == BF16_GEMV_MAX_ROWS
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step,
                                                                [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 1e-5)
    # the step does read the weights: with one layer's gate/up weight zeroed its output moves
    gate_up = inner.layers[1].mlp.gate_up_proj.weight
    saved = gate_up.clone()
    gate_up.zero_()
    try:
        _, _, zeroed, _ = _both_paths(model, loaded.arch, step, [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    finally:
        gate_up.copy_(saved)
    assert float((zeroed - one_call).norm() / one_call.norm()) > 1e-2


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_fp8_weights(tmp_path, isa: str) -> None:
    """FP8 weights (`--quantization fp8`) under float32 activations, on a Qwen2-shaped model (q/k/v biases, a down
    projection of 100 inputs: a tail past the 32-wide steps): the one-call step reads the e4m3 bytes with the
    per-layer path's gemv_fp8 kernel, so the two agree bit for bit on the best ISA; it serves no more rows than the
    per-layer path runs that kernel for, and it reads the weights (a zeroed one moves its output)."""
    from transformers import Qwen2Config

    from loom.kernels.decode_step import ModelDecodeStep
    from loom.quant.methods import FP8_GEMV_MAX_ROWS, Fp8LinearMethod
    from tests.model.model_harness import save_tiny_model

    config = Qwen2Config(vocab_size=96, hidden_size=80, intermediate_size=100, num_hidden_layers=2,
                         num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=128)
    save_tiny_model(config, tmp_path, seed=7, safe_serialization=True)
    if get_kernel("decode_step") is None or get_kernel("gemv_fp8") is None:
        pytest.skip("the kernels do not build here (no compiler)")
    loaded = load_model(str(tmp_path), torch.float32, CPU, quantization="fp8")
    model, inner = loaded.model, loaded.model.model
    qkv = inner.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and qkv.fp8_weight.dtype == torch.float8_e4m3fn
    assert qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)  # the biases reach the step
    assert inner.decode_step is not None and inner.decode_step.max_rows == FP8_GEMV_MAX_ROWS
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=FP8_GEMV_MAX_ROWS + 16)
    assert step.max_rows == FP8_GEMV_MAX_ROWS
    prompts = [[1, 2, 3, 4, 5], [9] * 20, [7] * 17]
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step, prompts)
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 1e-5)
    gate_up = inner.layers[1].mlp.gate_up_proj.fp8_weight
    saved = gate_up.clone()
    gate_up.view(torch.uint8).zero_()
    try:
        _, _, zeroed, _ = _both_paths(model, loaded.arch, step, prompts)
    finally:
        gate_up.copy_(saved)
    assert float((zeroed - one_call).norm() / one_call.norm()) > 1e-2


def test_bf16_weights_under_bfloat16_activations_keep_the_per_layer_path(tmp_path) -> None:
    """gemv_w16 takes float32 activations only, so a bfloat16 model with bf16 weights is not the C step's."""
    from transformers import LlamaConfig

    from tests.model.model_harness import save_tiny_model

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny_model(config, tmp_path, seed=3)
    assert load_model(str(tmp_path), torch.bfloat16, CPU, quantization="bf16").model.model.decode_step is None
    assert load_model(str(tmp_path), torch.float32, CPU, quantization="bf16").model.model.decode_step is not None \
        or get_kernel("decode_step") is None


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_w8a8(isa: str) -> None:
    """W8A8 (q8g weights per channel, int8 activations per token after the Hadamard rotation): the one-call step
    rotates, quantizes and multiplies with the per-layer path's C kernels (exact int32 dots, whose bits torch's int8
    GEMM gives too where the per-layer path takes it), so the two agree bit for bit on the best ISA."""
    from loom.kernels.decode_step import ModelDecodeStep, supports_model

    loaded = load_model(None, torch.float32, CPU, quantization="w8a8")
    model, inner = loaded.model, loaded.model.model
    if get_kernel("decode_step") is None:
        pytest.skip("the kernels do not build here (no compiler)")
    linears = [lin for layer in inner.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(lin.rotation_block > 0 and lin.int_gemm for lin in linears)
    assert supports_model(inner) and inner.decode_step is not None
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step,
                                                                [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17])
    # another ISA sums the float32 scaling in another order; a last-bit difference can move an int8 activation
    # code by one step (1/127 of its row's max) in a later layer: ~1.5% relative after 30 layers
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 5e-2)


@pytest.mark.parametrize("isa", kernel_isas("decode_step"))
def test_decode_step_runs_gptq_groups_of_several_blocks(tmp_path, isa: str) -> None:
    """A GPTQ checkpoint with 4-bit groups of 64 (asymmetric: mins) keeps its groups at run time (one scale and min
    per 64 weights read, not the 32-groups it used to be expanded to), and the one-call step, which passes each
    weight's group to the kernels, equals the per-layer path bit for bit on the best ISA."""
    from transformers import LlamaConfig

    from loom.kernels.decode_step import ModelDecodeStep
    from loom.quant.gptq_checkpoint import GPTQSettings, write_gptq_checkpoint
    from tests.model.model_harness import save_tiny_model
    from tests.quant.checkpoint_harness import windows

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny_model(config, tmp_path / "hf", seed=6)
    write_gptq_checkpoint(str(tmp_path / "hf"), str(tmp_path / "q"), GPTQSettings("rtn", 4, 64, False, False),
                          windows(96), calibration="random ids")
    loaded = load_model(str(tmp_path / "q"), torch.float32, CPU)
    model, inner = loaded.model, loaded.model.model
    if get_kernel("decode_step") is None:
        pytest.skip("the decode step does not build here (no compiler)")
    for layer in inner.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert all(p.layout in ("q4g", "q4gr16") and p.group_size == 64 and p.mins is not None
                       for p in lin.packed)
    assert inner.decode_step is not None
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    per_layer, per_layer_caches, one_call, caches = _both_paths(model, loaded.arch, step,
                                                                [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    _assert_paths_agree(isa, per_layer, per_layer_caches, one_call, caches, 1e-4)
