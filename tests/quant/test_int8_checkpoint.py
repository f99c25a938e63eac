"""compressed-tensors INT8 checkpoints (W8A8 dynamic / static, W8A16), written here from tiny models in the layout
llm-compressor writes (loom/quant/int8_checkpoint.py's table), loaded and run on loom's packed int8 path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loom.model.loader import load_model
from loom.model.loader.model_loader import default_quantization
from loom.quant.methods import int8_gemm_pays
from tests.model.model_harness import PagedHarness, TinyModel

CPU = torch.device("cpu")
PROMPT = [5, 9, 11, 20, 31, 2, 7, 40, 41, 13, 60, 61]
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _input_absmax(tiny: TinyModel) -> dict[str, float]:
    """max |x| of each projection's input over PROMPT, from the transformers model (static scales' calibration)."""
    seen: dict[str, float] = {}
    hooks = []
    for name, module in tiny.hf.named_modules():
        if name.rpartition(".")[2] in _PROJ:
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, n=name: seen.__setitem__(n, max(seen.get(n, 0.0), float(args[0].abs().max())))))
    with torch.no_grad():
        tiny.hf(torch.tensor([PROMPT]))
    for h in hooks:
        h.remove()
    return seen


def write_int8_checkpoint(tiny: TinyModel, out: Path, activations: str | None, scale_dtype=torch.float32) -> Path:
    """tiny's linear weights as int8 codes with a float16-exact scale per output channel (so loom's float16
    scales are the file's own), the rest as float32; activations None (weights only), "dynamic" or "static"."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {}
    absmax = _input_absmax(tiny) if activations == "static" else {}
    for name, t in tiny.hf.state_dict().items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rpartition(".")[2] in _PROJ:
            scale = (t.float().abs().amax(dim=1, keepdim=True) / 127).half().float()
            tensors[name] = (t.float() / scale).round().clamp(-127, 127).to(torch.int8)
            tensors[f"{module}.weight_scale"] = scale.to(scale_dtype)
            if activations == "static":
                tensors[f"{module}.input_scale"] = torch.tensor([absmax[module] / 127], dtype=scale_dtype)
        elif not (name == "lm_head.weight" and tiny.hf.config.tie_word_embeddings):
            tensors[name] = t.float().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((tiny.path / "config.json").read_text())
    acts = {None: None, "dynamic": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                     "dynamic": True},
            "static": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": acts[activations]}},
        "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _dequantized_copy(src: Path, out: Path) -> Path:
    """The same checkpoint with every int8 weight replaced by codes x scale (float32) and no quantization_config:
    the function an int8 checkpoint approximates, before activation rounding."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    dense = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if t.dtype == torch.int8:
            t = t.float() * tensors[name.removesuffix("weight") + "weight_scale"].float()
        dense[name] = t
    out.mkdir(parents=True)
    save_file(dense, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _logits(loaded) -> torch.Tensor:  # noqa: ANN001 (LoadedModel)
    harness = PagedHarness(loaded.model, loaded.arch, block_size=4)
    rows = [harness.step({0: PROMPT})[0]]  # 12 rows
    for token in (3, 17):
        rows.append(harness.step({0: [token]})[0])  # 1 row
    return torch.cat(rows)


@pytest.mark.parametrize("activations,method,tol", [("dynamic", "w8a8", 0.08), ("static", "w8a8", 0.15),
                                                    (None, "w8a16", 2e-3)])
def test_int8_checkpoint_runs_its_own_codes(tiny_models, tmp_path: Path, activations, method: str, tol: float) -> None:
    tiny = tiny_models["qwen2_gqa"]  # biases on q/k/v ride along
    ckpt = write_int8_checkpoint(tiny, tmp_path / "int8", activations, scale_dtype=torch.bfloat16)
    assert default_quantization(str(ckpt)) == method
    loaded = load_model(str(ckpt), torch.float32, CPU)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_format()[0].startswith("int8_") and "q8g/channel" in qkv.weight_format()[0]
    assert qkv.int_gemm == (activations is not None)
    assert qkv.int_gemm_torch == (activations is not None and int8_gemm_pays())
    assert "GGUF" not in loaded.model.lm_head.weight_format()[0]  # "ignore": the LM head stays float
    dense = load_model(str(_dequantized_copy(ckpt, tmp_path / "dense")), torch.float32, CPU, quantization="none")
    ref, got = _logits(dense), _logits(loaded)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < tol, rel
    if activations == "static":  # the largest of the q/k/v input scales (one input)
        assert qkv.input_scale == max(qkv.input_scales) and len(set(qkv.input_scales)) == 1


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_int8_gemm_uses_the_file_codes_exactly(tiny_models, tmp_path: Path, activations: str) -> None:
    """The int32 sums of the file's int8 codes with the activation codes (per token,
    or round(x / input_scale) with the file's scale), times the file's weight scale then the activation scale, bit
    for bit."""
    from safetensors.torch import load_file

    ckpt = write_int8_checkpoint(tiny_models["llama_gqa"], tmp_path / "int8", activations)
    loaded = load_model(str(ckpt), torch.float32, CPU)
    layer = loaded.model.model.layers[1].mlp.down_proj
    file = load_file(str(ckpt / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    codes, scale = file[f"{prefix}.weight"], file[f"{prefix}.weight_scale"]
    x = torch.randn(13, layer.input_size)
    if activations == "dynamic":
        xa = layer.quant_method.kernels.quantize_activations(x, per_token=True)
        xq, xs = xa.xq, xa.xs[:, :1]
    else:
        s_in = float(file[f"{prefix}.input_scale"])
        xq, xs = (x / s_in).round().clamp(-127, 127), torch.full((x.shape[0], 1), s_in)
    want = (xq.double() @ codes.double().t()).float() * scale.float().t() * xs
    assert layer.int_gemm
    assert torch.equal(layer(x), want)  # torch's int8 GEMM or loom's kernel: exact sums either way


def test_int8_checkpoints_refused_by_field(tiny_models, tmp_path: Path) -> None:
    ckpt = write_int8_checkpoint(tiny_models["llama_gqa"], tmp_path / "int8", "dynamic")
    with pytest.raises(ValueError, match="use 'w8a8'"):
        load_model(str(ckpt), torch.float32, CPU, quantization="fp8")

    def variant(name: str, edit) -> Path:  # noqa: ANN001
        out = tmp_path / name
        shutil.copytree(ckpt, out)
        config = json.loads((out / "config.json").read_text())
        edit(config["quantization_config"]["config_groups"]["group_0"])
        (out / "config.json").write_text(json.dumps(config))
        return out

    cases = {
        "bits": (lambda g: g["weights"].update(num_bits=4), "weights must be num_bits 8"),
        "strategy": (lambda g: g["weights"].update(strategy="group"), "weights.strategy 'group'"),
        "acts": (lambda g: g["input_activations"].update(strategy="group"), "input_activations strategy 'group'"),
        "static": (lambda g: g["input_activations"].update(strategy="tensor", dynamic=False),
                   "need an input_scale for every quantized layer"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_model(str(variant(name, edit)), torch.float32, CPU)

    def top(name: str, key: str, value) -> Path:  # noqa: ANN001
        out = tmp_path / name
        shutil.copytree(ckpt, out)
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"][key] = value
        (out / "config.json").write_text(json.dumps(config))
        return out

    for name, key, value, message in (("status", "quantization_status", "frozen", "quantization_status 'frozen'"),
                                      ("kv", "kv_cache_scheme", {"num_bits": 8, "type": "float"}, "kv_cache_scheme")):
        with pytest.raises(ValueError, match=message):
            load_model(str(top(name, key, value)), torch.float32, CPU)
    with pytest.raises(ValueError, match="output_activations must be null"):
        load_model(str(variant("out", lambda g: g.update(output_activations={"num_bits": 8}))), torch.float32, CPU)
    with pytest.raises(ValueError, match="targets"):
        load_model(str(variant("targets", lambda g: g.update(targets=["re:.*q_proj$"]))), torch.float32, CPU)


def test_int8_checkpoint_tensors_refused(tiny_models, tmp_path: Path) -> None:
    """Found by the fresh-user trial: int8 codes whose weight_scale is missing loaded as float weights (garbage
    output), and NaN or infinite scales loaded too."""
    from safetensors.torch import load_file, save_file

    static = write_int8_checkpoint(tiny_models["llama_gqa"], tmp_path / "int8", "static")
    prefix = "model.layers.1.mlp.down_proj"

    def edited(name: str, change) -> Path:  # noqa: ANN001
        out = tmp_path / name
        shutil.copytree(static, out)
        tensors = load_file(str(out / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(out / "model.safetensors"))
        return out

    cases = {
        "no_scale": (lambda t: t.pop(f"{prefix}.weight_scale"), "without model.layers.1.mlp.down_proj.weight_scale"),
        "nan_scale": (lambda t: t[f"{prefix}.weight_scale"].__setitem__(0, float("nan")), "finite non-negative"),
        "inf_input": (lambda t: t.__setitem__(f"{prefix}.input_scale", torch.tensor([float("inf")])),
                      "must be a finite positive number"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_model(str(edited(name, change)), torch.float32, CPU)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_loom_writes_what_it_reads(tiny_models, tmp_path: Path, activations: str) -> None:
    """`loom quantize --method w8a8`'s writer: the format of the module docstring (int8 codes, float32 scales per
    channel that are float16-exact, input_scale only when static, the LM head left float), loaded back as its own
    codes; the SmoothQuant scales keep the float function (the smoothed float weights, dequantized, are close to
    the source model)."""
    from safetensors.torch import load_file

    from loom.quant.int8_checkpoint import write_int8_checkpoint as write

    tiny = tiny_models["qwen2_gqa"]
    windows = [[(7 * i + 3 * j) % 90 + 5 for j in range(40)] for i in range(3)]
    result = write(str(tiny.path), str(tmp_path / "ct"), windows, alpha=0.5, activations=activations)
    out = result["output"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "int-quantized" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"]["dynamic"] == (activations == "dynamic")
    file = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    assert file[f"{name}.weight"].dtype == torch.int8 and file[f"{name}.weight"].abs().max() <= 127
    scale = file[f"{name}.weight_scale"]
    assert scale.dtype == torch.float32 and scale.shape == (file[f"{name}.weight"].shape[0], 1)
    assert torch.equal(scale.half().float(), scale)
    assert (f"{name}.input_scale" in file) == (activations == "static") and "lm_head.weight_scale" not in file
    assert result["bits_per_weight"] == pytest.approx(8 + 32 / 64, abs=0.1)
    loaded = load_model(str(out), torch.float32, CPU)
    k_rows = loaded.arch.kv_size
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    packed = torch.cat([p.qweight for p in qkv.packed])
    assert torch.equal(packed[loaded.arch.q_size : loaded.arch.q_size + k_rows], file[f"{name}.weight"])
    dense = load_model(str(_dequantized_copy(out, tmp_path / "dense")), torch.float32, CPU, quantization="none")
    source = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    ref, got = _logits(source), _logits(dense)
    assert float((got - ref).norm() / ref.norm()) < 0.05  # int8 weights of the smoothed model, float activations
    with pytest.raises(ValueError, match="activations must be 'dynamic' or 'static'"):
        write(str(tiny.path), str(tmp_path / "bad"), windows, activations="per-channel")


def test_activation_scales_apply_to_w8a8_only(tmp_path: Path) -> None:
    from loom.quant.quantize import quantize

    with pytest.raises(ValueError, match="activation_scales applies to method 'w8a8', not 'rtn'"):
        quantize(None, str(tmp_path / "o"), "rtn", activation_scales="static")
    with pytest.raises(ValueError, match="activation_scales must be 'dynamic' or 'static'"):
        quantize(None, str(tmp_path / "o"), "w8a8", activation_scales="token")


def test_layers_the_packed_layout_cannot_hold_run_dense() -> None:
    """An input size that is not a multiple of 32, or a scale outside float16's normal range (2e-8 would flush to
    zero, 1e-6 lose 1.3%: review finding), dequantizes that projection to float32 instead."""
    from loom.quant.int8_checkpoint import _packed
    from loom.quant.layout import PackedWeight

    codes = torch.randint(-127, 128, (6, 64), dtype=torch.int8)
    assert isinstance(_packed("p", codes, torch.full((6, 1), 0.01)), PackedWeight)
    for weight, scale in ((codes[:, :40], torch.full((6, 1), 0.01)), (codes, torch.full((6, 1), 2e-8)),
                          (codes, torch.tensor([1e-6]))):
        dense = _packed("p", weight.contiguous(), scale)
        assert isinstance(dense, torch.Tensor) and torch.equal(dense, weight.float() * scale.float().reshape(-1, 1))


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_int8_checkpoints_decode_through_the_c_step(tiny_models, tmp_path: Path, activations: str) -> None:
    """A compressed-tensors W8A8 checkpoint, dynamic or static activation scales (q/k/v biases included), decodes
    through the C decode step, which quantizes (per token, or round(x / input_scale) clamped) and multiplies as the
    per-layer path does: equal bit for bit on the best ISA."""
    from loom.kernels.decode_step import ModelDecodeStep, supports_model
    from loom.kernels.registry import get_kernel, kernel_isas
    from tests.kernels.test_decode_step import _assert_paths_agree, _both_paths

    if get_kernel("decode_step") is None:
        pytest.skip("the kernels do not build here (no compiler)")
    ckpt = write_int8_checkpoint(tiny_models["qwen2_gqa"], tmp_path / "int8", activations)
    loaded = load_model(str(ckpt), torch.float32, CPU)
    inner = loaded.model.model
    assert supports_model(inner) and inner.decode_step is not None
    isa = kernel_isas("decode_step")[0]
    step = ModelDecodeStep(get_kernel("decode_step", isa=isa), inner, max_rows=16)
    results = _both_paths(loaded.model, loaded.arch, step, [[1, 2, 3, 4, 5], [9] * 20, [7] * 17])
    _assert_paths_agree(isa, *results, 0.0)
