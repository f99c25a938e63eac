"""GPTQ onto W8A8's int8 per-channel grid (loom/quant/gptq.gptq_int8_per_channel) and `loom quantize --method
smoothquant|w8a8 --weight-rounding gptq` (loom/quant/gptq_w8a8.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.model.loader import load_model
from loom.quant.gptq import accumulate_hessian, gptq_int8_per_channel
from loom.quant.rtn import quantize_q8
from tests.quant.test_gptq import correlated_inputs

CPU = torch.device("cpu")


def _rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = quantize_q8(w, w.shape[1])
    return p.qweight, p.scales.reshape(-1)


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_int8_lowers_the_output_error_on_rtns_grid(act_order: bool) -> None:
    """Same grid as RTN (quantize_q8 per channel: the same float16 scales, codes in -127..127), and a smaller
    output error on the calibration inputs."""
    n, k = 40, 192
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    w[3] = 0.0  # an all-zero row: codes 0
    x = correlated_inputs(k, 768, seed=4)
    h, _ = accumulate_hessian(None, 0, x)
    codes, scales = gptq_int8_per_channel(w, h, act_order=act_order)
    rtn_codes, rtn_scales = _rtn(w)
    assert codes.dtype == torch.int8 and codes.shape == (n, k) and int(codes.abs().max()) <= 127
    assert scales.dtype == torch.float16 and torch.equal(scales, rtn_scales)
    assert not codes[3].any()
    err = float((x @ (w - codes.float() * scales.float()[:, None]).T).square().sum())
    err_rtn = float((x @ (w - rtn_codes.float() * rtn_scales.float()[:, None]).T).square().sum())
    assert err < 0.7 * err_rtn
    assert not torch.equal(codes, rtn_codes)


def test_gptq_int8_is_rtn_when_the_inputs_are_uncorrelated() -> None:
    """With a diagonal Hessian no rounding error has anywhere to go (H^-1 is diagonal): GPTQ's codes are RTN's.
    Inputs the calibration never saw (zero diagonal) take weight 0."""
    n, k = 16, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    diag = torch.rand(k, generator=torch.Generator().manual_seed(6)) + 0.5
    codes, scales = gptq_int8_per_channel(w, torch.diag(diag))
    rtn_codes, rtn_scales = _rtn(w)
    assert torch.equal(codes, rtn_codes) and torch.equal(scales, rtn_scales)
    diag[7] = 0.0
    codes, _ = gptq_int8_per_channel(w, torch.diag(diag))
    assert not codes[:, 7].any()
    with pytest.raises(ValueError, match=r"hessian must be \[96, 96\]"):
        gptq_int8_per_channel(w, torch.eye(95))
    with pytest.raises(ValueError, match="percdamp must be in"):
        gptq_int8_per_channel(w, torch.eye(96), percdamp=0.0)


def _windows(vocab: int, n: int = 3, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _calibration_logits(path, window: list[int], quantization: str | None = None) -> torch.Tensor:  # noqa: ANN001
    from tests.model.model_harness import PagedHarness

    loaded = load_model(str(path), torch.float32, CPU, quantization=quantization)
    return PagedHarness(loaded.model, loaded.arch, block_size=4).step({0: window})[0]


def test_smoothquant_with_gptq_weights_loads_onto_its_codes_and_lowers_the_error(tiny_models, tmp_path) -> None:
    """`--method smoothquant --weight-rounding gptq`: a dense float checkpoint whose decoder weights, rotated as
    run-time w8a8 rotates them, sit on GPTQ's int8 grid; loading it as w8a8 recovers GPTQ's codes and scales for
    every row whose codes reach +-127 and lands within half a (finer) step of the others, and on calibration
    tokens its logits are closer to the source model's than those of the RTN checkpoint."""
    from loom.quant.gptq_w8a8 import gptq_w8a8_weights
    from loom.quant.quantize import CONFIG_KEY, smoothed_source, smoothquant_checkpoint

    tiny = tiny_models["qwen2_gqa"]
    windows = _windows(tiny.hf.config.vocab_size)
    smoothquant_checkpoint(str(tiny.path), str(tmp_path / "rtn"), windows)
    result = smoothquant_checkpoint(str(tiny.path), str(tmp_path / "gptq"), windows, weight_rounding="gptq")
    config = json.loads((result.output / "config.json").read_text())
    assert config[CONFIG_KEY]["weight_rounding"] == "gptq" and config[CONFIG_KEY]["method"] == "w8a8"
    loaded_src, _, smoothed, _ = smoothed_source(str(tiny.path), windows, 0.5, "smoothquant", "")
    expected = gptq_w8a8_weights(loaded_src.arch, smoothed, windows, rotated=True)
    codes, scales = expected["model.layers.1.mlp.down_proj"]
    loaded = load_model(str(result.output), torch.float32, CPU)  # the prepared method: w8a8
    down = loaded.model.model.layers[1].mlp.down_proj
    assert down.rotation_block > 1
    assert "GPTQ-rounded" in down.quant_method.weight_format(down)[0]  # the start-up report says where codes came from
    got, got_scales = down.packed[0].qweight, down.packed[0].scales.reshape(-1)
    reaches = codes.abs().amax(dim=1) == 127
    assert int(reaches.sum()) >= codes.shape[0] // 2
    assert torch.equal(got[reaches], codes[reaches]) and torch.equal(got_scales[reaches], scales[reaches])
    values = codes.float() * scales.float()[:, None]
    step = got_scales.float()[:, None]
    assert bool(((got.float() * step - values).abs() <= step / 2 + 1e-6).all())
    window = windows[0]
    source = _calibration_logits(tiny.path, window, "none")
    err_gptq = float((_calibration_logits(result.output, window) - source).norm())
    err_rtn = float((_calibration_logits(tmp_path / "rtn", window) - source).norm())
    assert err_gptq < err_rtn


def test_w8a8_checkpoint_with_gptq_weights_holds_gptqs_codes(tiny_models, tmp_path) -> None:
    """`--method w8a8 --weight-rounding gptq` (llm-compressor's SmoothQuant + GPTQ recipe): the same
    compressed-tensors layout, the codes differ from RTN's on the same scales, and the model runs them."""
    from safetensors.torch import load_file

    from loom.quant.int8_checkpoint import write_int8_checkpoint

    tiny = tiny_models["qwen2_gqa"]
    windows = _windows(tiny.hf.config.vocab_size)
    rtn = write_int8_checkpoint(str(tiny.path), str(tmp_path / "rtn"), windows)["output"]
    gptq = write_int8_checkpoint(str(tiny.path), str(tmp_path / "gptq"), windows, weight_rounding="gptq")["output"]
    a, b = load_file(str(rtn / "model.safetensors")), load_file(str(gptq / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj"
    assert b[f"{name}.weight"].dtype == torch.int8 and torch.equal(a[f"{name}.weight_scale"], b[f"{name}.weight_scale"])
    assert not torch.equal(a[f"{name}.weight"], b[f"{name}.weight"])
    loaded = load_model(str(gptq), torch.float32, CPU)
    gate_up = torch.cat([p.qweight for p in loaded.model.model.layers[0].mlp.gate_up_proj.packed])
    assert torch.equal(gate_up[: b[f"{name}.weight"].shape[0]], b[f"{name}.weight"])
    source = _calibration_logits(tiny.path, windows[0], "none")
    err_gptq = float((_calibration_logits(gptq, windows[0]) - source).norm())
    err_rtn = float((_calibration_logits(rtn, windows[0]) - source).norm())
    assert err_gptq < err_rtn


def test_weight_rounding_is_checked(tmp_path) -> None:
    from loom.quant.quantize import quantize

    with pytest.raises(ValueError,
                       match="weight_rounding applies to methods 'smoothquant', 'w8a8' and 'awq', not 'gptq'"):
        quantize(None, str(tmp_path / "o"), "gptq", weight_rounding="gptq")
    with pytest.raises(ValueError, match=r"weight_rounding must be one of \['rtn', 'gptq'\], got 'awq'"):
        quantize(None, str(tmp_path / "o"), "smoothquant", weight_rounding="awq")
    assert not (tmp_path / "o").exists()


def test_an_already_quantized_source_is_refused_by_name(tmp_path) -> None:
    """`loom quantize --model DIR` of a GPTQ / AWQ / compressed-tensors checkpoint said "quantization='none' cannot
    run this ... checkpoint" (an option the user never gave); it now names the model and why."""
    from loom.quant.quantize import quantize

    src = tmp_path / "ct"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 "quantization_config": {"quant_method": "compressed-tensors"}}))
    with pytest.raises(ValueError, match=r"is already quantized \(compressed-tensors weights\): loom quantize starts"):
        quantize(str(src), str(tmp_path / "out"), "smoothquant")
    assert not (tmp_path / "out").exists()
