"""Every --quantization method end to end on tiny random checkpoints: it loads through the seam, runs the prefill
(dequantize + GEMM) and decode (packed kernels, or the one-call step) paths, and stays near the dense model."""

from __future__ import annotations

import pytest
import torch

from loom.model.loader import load_model
from loom.quant.config import LM_HEAD_SCHEME
from loom.quant.methods import Fp8LinearMethod, PackedLinearMethod
from tests.model.model_harness import PagedHarness

CPU = torch.device("cpu")
PROMPT = [5, 9, 11, 20, 31, 2, 7, 40, 41, 13]


def _logits(model, arch) -> torch.Tensor:
    """Logits of a prefill of PROMPT, then of 3 single-token decode steps."""
    harness = PagedHarness(model, arch, block_size=4)
    rows = [harness.step({0: PROMPT})[0]]
    for token in (3, 17, 29):
        rows.append(harness.step({0: [token]})[0])
    return torch.cat(rows)


@pytest.mark.parametrize("method", ["w8a16", "w4a16", "w8a8", "fp8"])
@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha_tied", "qwen2_gqa", "qwen3_qknorm", "olmo2_postnorm",
                                  "phi3_fused"])
def test_quantized_methods_stay_near_the_dense_model(tiny_models, name: str, method: str) -> None:
    path = str(tiny_models[name].path)
    dense = load_model(path, torch.float32, CPU, quantization="none")
    quant = load_model(path, torch.float32, CPU, quantization=method)
    head = quant.model.lm_head.quant_method
    kinds = {type(m.quant_method) for m in quant.model.modules() if hasattr(m, "quant_method") and m.quant_method
             is not head}
    assert kinds == {Fp8LinearMethod if method == "fp8" else PackedLinearMethod}  # every linear
    # the LM head of the lossier methods stays 8-bit weight-only (LM_HEAD_SCHEME)
    assert isinstance(head, PackedLinearMethod) and head.scheme.name == LM_HEAD_SCHEME.get(method, method)
    if method in ("w8a16", "w4a16"):  # float activations: the one-call C step, except for post-norm layers
        assert (quant.model.model.decode_step is None) == name.startswith("olmo2")
    ref, got = _logits(dense.model, dense.arch), _logits(quant.model, quant.arch)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # relative error of the logits on random O(1) weights through 2 layers (measured: int8 ~1-5%, 4-bit ~33%,
    # fp8 ~10%); a wrong kernel or layout gives ~100%
    rel = float((got - ref).norm() / ref.norm())
    assert rel < {"w8a16": 0.03, "w8a8": 0.08, "w4a16": 0.5, "fp8": 0.3}[method], rel


def test_an_input_size_the_layout_does_not_take_stays_dense(tmp_path) -> None:
    from transformers import LlamaConfig

    from tests.model.model_harness import save_tiny_model

    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    save_tiny_model(config, tmp_path, seed=3)
    loaded = load_model(str(tmp_path), torch.float32, CPU, quantization="w4a16")
    q = loaded.model.model.layers[0].self_attn.qkv_proj  # input 48: not a multiple of 32
    d = loaded.model.model.layers[0].mlp.down_proj  # input 64: packed
    assert not isinstance(q.quant_method, PackedLinearMethod) and isinstance(d.quant_method, PackedLinearMethod)
    assert torch.isfinite(_logits(loaded.model, loaded.arch)).all()


def test_gguf_quantization_needs_a_gguf_file(tiny_models) -> None:
    with pytest.raises(ValueError, match="needs a GGUF file"):
        load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="int3")


def test_w8a8_above_the_kernel_rows_is_one_exact_int8_gemm(tiny_models, monkeypatch) -> None:
    """w8a8 multiplies in torch's int8 GEMM at every row count: the int32 sums of the per-token codes and
    the per-channel weight codes, times s_w then s_x, bit for bit a float64-checked integer product; per row it equals
    the per-block kernel's result to float32 rounding (the activations stay int8 per token, or a request's tokens
    would depend on its batch: found by a fresh-user trial)."""
    from loom.quant.hadamard import rotate_input
    import loom.quant.methods as methods

    # the int8 GEMM is taken where it is exact and the CPU has VNNI or AMX; with those flags named here, where it
    # is exact (torch's fallback on an AVX2 CPU is exact, only slow), so that this path runs on every machine
    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    loaded = load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="w8a8")
    layer = loaded.model.model.layers[0].mlp.down_proj
    (w,) = layer.packed
    assert w.group_size == layer.input_size and w.mins is None  # one scale per output channel
    assert layer.int_gemm  # exact int32 dots: torch's int8 GEMM where exact, else loom's kernel (the same bits)
    assert layer.int_gemm_torch == methods.int8_gemm_is_exact()
    x = torch.randn(64, layer.input_size)
    one_row = torch.cat([layer(x[i : i + 1]) for i in range(64)])
    gemm = layer(x)  # 64 rows: the int8 GEMM (or, without an exact one, loom's kernel)
    assert torch.equal(gemm, one_row)  # the same bits whatever the number of rows: a prefix hit cannot change a token
    xa = layer.quant_method.kernels.quantize_activations(rotate_input(x, layer.rotation_block), per_token=True)
    exact = xa.xq.double() @ w.qweight.double().t()  # integer sums, exact in float64
    want = exact.float() * w.scales.float().t() * xa.xs[:, :1]
    assert torch.equal(gemm, want)
    layer.int_gemm_torch = not layer.int_gemm_torch  # the other implementation: the same bits
    assert torch.equal(layer(x), want)


def test_an_int8_gemm_that_saturates_is_not_used(tiny_models, monkeypatch) -> None:
    """oneDNN's AVX2 int8 kernel adds pairs of (x + 128) * w products in int16 and saturates (review finding): the
    self-check refuses such a GEMM and w8a8 keeps loom's exact kernel, whose rows equal the one-row results."""
    import loom.quant.methods as methods

    def saturating_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        pairs = ((a.long() + 128).reshape(a.shape[0], -1, 2, 1) * b.long().reshape(1, -1, 2, b.shape[1])).sum(2)
        return (pairs.clamp(-32768, 32767).sum(1) - 128 * b.long().sum(0)).int()

    monkeypatch.setattr(torch, "_int_mm", saturating_int_mm)
    methods.int8_gemm_is_exact.cache_clear()
    try:
        assert not methods.int8_gemm_is_exact()
        loaded = load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="w8a8")
        layer = loaded.model.model.layers[0].mlp.down_proj
        assert layer.int_gemm and not layer.int_gemm_torch
        x = torch.randn(12, layer.input_size)
        rows = torch.cat([layer(x[i : i + 1]) for i in range(12)])
        assert torch.equal(layer(x), rows)
    finally:
        methods.int8_gemm_is_exact.cache_clear()


def test_w8a8_without_int8_dot_products_keeps_the_kernels_at_every_row_count(tiny_models, monkeypatch) -> None:
    """On a CPU without VNNI or AMX torch's int8 GEMM is exact but a scalar loop (16 s of TTFT at 512 tokens on a
    Zen 3, where loom's kernels take 1.3 s): w8a8 keeps loom's exact kernel there, at every row count, so that a
    token's result does not depend on how many rows its step had."""
    import loom.quant.methods as methods

    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert not methods.int8_gemm_pays()
    loaded = load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="w8a8")
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert layer.int_gemm and not layer.int_gemm_torch
    x = torch.randn(200, layer.input_size)  # above every dense_min_rows
    rows = torch.cat([layer(x[i : i + 1]) for i in range(200)])
    assert torch.equal(layer(x), rows)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha_tied", "qwen2_gqa"])
def test_bf16_weights_equal_the_float32_model_on_a_bf16_checkpoint(tiny_models, tmp_path, name: str) -> None:
    """--quantization bf16 keeps a bf16 checkpoint's weights at their values: the same model as float32
    weights, up to float32 summation order (loom's gemv_w16 at decode, F.linear on the widened weight at
    prefill)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from loom.quant.methods import Bf16WeightMethod

    src = tiny_models[name].path
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.bfloat16().contiguous() for k, v in load_file(f).items()}, tmp_path / f.name)
        elif f.is_file():
            shutil.copy(f, tmp_path / f.name)
    dense = load_model(str(tmp_path), torch.float32, CPU, quantization="none")
    half = load_model(str(tmp_path), torch.float32, CPU, quantization="bf16")
    layers = [m for m in half.model.modules() if hasattr(m, "quant_method")]
    assert layers and all(isinstance(m.quant_method, Bf16WeightMethod) for m in layers)
    assert all(m.weight.dtype == torch.bfloat16 for m in layers)
    ref, got = _logits(dense.model, dense.arch), _logits(half.model, half.arch)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-5, rel


def test_q4_layers_are_interleaved_where_the_kernels_have_row_groups(tiny_models) -> None:
    """w4a16 on a CPU whose best qgemm build has the 16-row groups (avx512_vnni): every q4g part of whole groups
    of 16 rows is kept as q4gr16 (one summation order at every row count), the rest as q4g; elsewhere all
    q4g."""
    from loom.quant.methods import quant_kernels

    interleave = "q4gr16" in quant_kernels(CPU).interleaved_layouts
    loaded = load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="w4a16")
    layouts = {}
    for m in loaded.model.modules():
        for p in getattr(m, "packed", None) or []:
            if p.layout != "q8g":
                layouts[p.layout, p.shape[0] % 16 == 0] = True
    assert layouts, "no 4-bit part"
    for layout, whole in layouts:
        assert layout == ("q4gr16" if interleave and whole else "q4g"), (layout, whole)


def test_dense_float32_layers_of_quantized_models_run_loom_gemv_for_decode_rows() -> None:
    """default_linear_method with float32_kernels (a quantization config other than `none`): up to
    F32_GEMV_MAX_ROWS rows through gemv_f32 (within float32 rounding of F.linear), above them F.linear itself;
    without float32_kernels (the oracle) torch's F.linear at every size."""
    from loom.kernels.registry import get_kernel
    from loom.model.layers.linear import (
        F32_GEMV_MAX_ROWS,
        Float32GemvLinearMethod,
        Linear,
        UnquantizedLinearMethod,
        default_linear_method,
    )

    cpu = torch.device("cpu")
    assert type(default_linear_method(torch.float32, cpu)) is UnquantizedLinearMethod
    method = default_linear_method(torch.float32, cpu, float32_kernels=True)
    if get_kernel("gemv_f32") is None:
        pytest.skip("gemv_f32 does not build here (no C compiler?)")
    assert type(method) is Float32GemvLinearMethod
    torch.manual_seed(0)
    layer = Linear(96, 200, True, torch.float32, cpu, method)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    for rows in (1, 3, F32_GEMV_MAX_ROWS, F32_GEMV_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 96)
        y, ref = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
        if rows <= F32_GEMV_MAX_ROWS:
            assert torch.equal(y, method.gemv(x, layer.weight, layer.bias))
            assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, ref)


def test_fp8_weights_stay_e4m3_on_the_cpu_under_float32_activations(tiny_models) -> None:
    """--quantization fp8 with float32 activations on the CPU keeps each projection's e4m3 bytes and per-channel
    scales (a quarter of float32's bytes; the start-up report counts them): up to FP8_GEMV_MAX_ROWS rows through
    loom's gemv_fp8, above them F.linear on the weight dequantized per call, which is `fp8 * scale` exactly, so
    both stay within float32 rounding of F.linear on the weight dequantized once (the path without kernels)."""
    from loom.kernels.registry import get_kernel
    from loom.quant.methods import FP8_GEMV_MAX_ROWS

    if get_kernel("gemv_fp8") is None:
        pytest.skip("gemv_fp8 does not build here (no C compiler?)")
    loaded = load_model(str(tiny_models["qwen2_gqa"].path), torch.float32, CPU, quantization="fp8")
    layer = loaded.model.model.layers[0].self_attn.qkv_proj  # with q/k/v biases
    assert layer.dense_weight is None and layer.fp8_weight.dtype == torch.float8_e4m3fn
    n, k = layer.fp8_weight.shape
    assert layer.quant_method.weight_format(layer) == ("fp8_e4m3", n * k + 4 * n)
    dense = layer.fp8_weight.float() * layer.fp8_scale[:, None]
    torch.manual_seed(0)
    for rows in (1, 2, 3, FP8_GEMV_MAX_ROWS, FP8_GEMV_MAX_ROWS + 1, 40):
        x = torch.randn(rows, k)
        y, ref = layer(x), torch.nn.functional.linear(x, dense, layer.bias)
        if rows <= FP8_GEMV_MAX_ROWS:
            assert torch.equal(y, layer.fp8_kernel(x, layer.fp8_weight, layer.fp8_scale, layer.bias))
            assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, ref)
    # bfloat16 activations: the weight dequantized once at load, as before the kernel
    half = load_model(str(tiny_models["qwen2_gqa"].path), torch.bfloat16, CPU, quantization="fp8")
    layer = half.model.model.layers[0].self_attn.qkv_proj
    assert layer.fp8_weight is None and layer.dense_weight.dtype == torch.bfloat16


def test_an_fp8_weight_holding_nan_is_refused(tiny_models, tmp_path) -> None:
    """gemv_fp8 does not decode the NaN bytes (0x7F, 0xFF) as NaN, so a checkpoint holding them is refused at load,
    naming the layer, rather than run with wrong finite weights; so is a NaN, infinite or negative weight_scale
    (which loaded and gave empty or garbled text: the fresh-user trial)."""
    from safetensors.torch import load_file, save_file

    from loom.quant.fp8_checkpoint import write_fp8_checkpoint

    out = tmp_path / "fp8"
    write_fp8_checkpoint(str(tiny_models["llama_gqa"].path), str(out))
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    clean = tensors[name].view(torch.uint8).clone()
    for nan in (0xFF, 0x7F):  # -NaN and +NaN
        raw = clean.clone()
        raw[3, 5] = nan
        tensors[name] = raw.view(torch.float8_e4m3fn)
        save_file(tensors, str(out / "model.safetensors"))
        with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj: the fp8 weight holds 1 NaN"):
            load_model(str(out), torch.float32, CPU)
    tensors[name] = clean.view(torch.float8_e4m3fn)
    scale_name = "model.layers.0.self_attn.k_proj.weight_scale"
    good = tensors[scale_name].clone()
    for value in (float("nan"), float("inf"), -0.5):  # a scale the kernel would multiply into garbage
        tensors[scale_name] = good.clone()
        tensors[scale_name][3] = value
        save_file(tensors, str(out / "model.safetensors"))
        with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj: the fp8 weight's scales hold 1 NaN"):
            load_model(str(out), torch.float32, CPU)
