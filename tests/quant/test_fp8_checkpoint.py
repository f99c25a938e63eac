"""`loom quantize --method fp8`: compressed-tensors FP8 checkpoints (e4m3 weights, a scale per output channel)
written, read back by loom's fp8 method, and refused clearly when loom cannot run them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from loom.model.loader import load_model
from loom.model.loader.model_loader import default_quantization
from loom.quant.fp8_checkpoint import read_fp8_checkpoint, write_fp8_checkpoint
from loom.quant.methods import Fp8LinearMethod
from loom.quant.rtn import quantize_fp8_e4m3

CPU = torch.device("cpu")


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """The float32 weight an fp8 layer multiplies: its e4m3 values times their scales (kept in fp8 for loom's
    gemv_fp8 kernel under float32 activations), or the matrix dequantized once at load (no kernels)."""
    if layer.dense_weight is not None:
        return layer.dense_weight
    assert layer.fp8_weight.dtype == torch.float8_e4m3fn and layer.fp8_scale.dtype == torch.float32
    return layer.fp8_weight.float() * layer.fp8_scale.reshape(-1, 1)


def test_fp8_checkpoint_follows_the_format_and_runs(tiny_models, tmp_path) -> None:
    tiny = tiny_models["qwen2_gqa"]  # q/k/v biases travel as float32
    out = tmp_path / "fp8"
    result = write_fp8_checkpoint(str(tiny.path), str(out))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["strategy"]) == (8, "float", "channel")
    h = tiny.hf.config.hidden_size
    assert result.bits_per_weight == pytest.approx(8 + 32 / h, rel=0.05)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").dtype == torch.float32
        assert "lm_head.weight_scale" not in set(f.keys())
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
    source = tiny.hf.model.layers[0].mlp.down_proj.weight.detach()
    q, scale = quantize_fp8_e4m3(source)  # what the file must hold
    assert torch.equal(w.float(), q.float()) and torch.equal(s, scale)

    assert default_quantization(str(out)) == "fp8"
    loaded = load_model(str(out), torch.float32, CPU)
    down = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(down.quant_method, Fp8LinearMethod)
    torch.testing.assert_close(_weight(down), q.float() * scale, rtol=0, atol=0)
    assert not isinstance(loaded.model.lm_head.quant_method, Fp8LinearMethod)
    # the same numbers as loom's run-time fp8 of the source (same rounding, same scales)
    runtime = load_model(str(tiny.path), torch.float32, CPU, quantization="fp8")
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        a = _weight(loaded.model.get_submodule(f"model.layers.1.{name}"))
        b = _weight(runtime.model.get_submodule(f"model.layers.1.{name}"))
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="cannot run an FP8 checkpoint"):
        load_model(str(out), torch.float32, CPU, quantization="w8a16")


@pytest.mark.parametrize(("patch", "message"), [
    ({"format": "pack-quantized"}, "float-quantized"),
    ({"config_groups": {}}, "exactly one group"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "num_bits 8, type 'float'"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "strategy"),
])
def test_fp8_configs_loom_cannot_run_are_named(patch, message: str) -> None:
    from loom.quant.fp8_checkpoint import fp8_quantization_config

    with pytest.raises(ValueError, match=message):
        read_fp8_checkpoint(fp8_quantization_config() | patch, {"model.layers.0.mlp.down_proj.weight_scale"})
    with pytest.raises(ValueError, match="without any weight_scale"):
        read_fp8_checkpoint(fp8_quantization_config(), {"model.layers.0.mlp.down_proj.weight"})


def test_per_tensor_scales_load_too(tiny_models, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    tiny = tiny_models["llama_gqa"]
    out = tmp_path / "fp8"
    write_fp8_checkpoint(str(tiny.path), str(out))
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj"
    w = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
    scale = w.abs().max() / 448
    tensors[f"{name}.weight"] = (w / scale).to(torch.float8_e4m3fn)
    tensors[f"{name}.weight_scale"] = scale.reshape(1)
    save_file(tensors, str(out / "model.safetensors"))
    loaded = load_model(str(out), torch.float32, CPU)
    got = _weight(loaded.model.get_submodule(name))
    assert torch.equal(got, tensors[f"{name}.weight"].float() * scale)


def test_float16_on_an_fp8_checkpoint_names_fp8(tiny_models, tmp_path) -> None:
    """--dtype float16 with the checkpoint's own quantization is refused naming that quantization (it said "gguf" for
    every checkpoint left on automatic quantization)."""
    from loom.worker.model_runner import resolve_dtype

    out = tmp_path / "fp8"
    write_fp8_checkpoint(str(tiny_models["llama_gqa"].path), str(out))
    with pytest.raises(ValueError, match="dtype float16 with quantization fp8 on the CPU"):
        resolve_dtype("float16", CPU, None, str(out))
