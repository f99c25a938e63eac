"""`loom quantize --method awq`: folding exact before rounding, AutoAWQ gemm checkpoints written, loaded by loom's
AWQ loader into q4g32, run end to end."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open

from loom.quant.layout import Q4_LAYOUTS
from loom.model.loader import load_model
from loom.quant.awq_checkpoint import write_awq_checkpoint
from loom.quant.awq_format import from_checkpoint
from loom.quant.awq_method import AWQLinearMethod
from loom.quant.awq_model import AWQSettings, fold_down, fold_gate_up, fold_o, fold_qkv, quantize_model_awq
from tests.model.model_harness import hf_logits

CPU = torch.device("cpu")


def _windows(vocab: int, n: int = 4, length: int = 48, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _logits(loaded, tokens: list[int]) -> torch.Tensor:
    from loom.bench.quality import window_logits

    return window_logits(loaded.model, loaded.arch, tokens)


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("name", ["llama_mha_tied", "qwen2_gqa"])
def test_folding_preserves_the_float_model(tiny_models, name: str) -> None:
    tiny = tiny_models[name]
    loaded = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    arch = loaded.arch
    tokens = _windows(tiny.hf.config.vocab_size, 1, 40, seed=3)[0]
    before = _logits(loaded, tokens)
    g = torch.Generator().manual_seed(4)

    def rand(n: int) -> torch.Tensor:
        return torch.exp(torch.randn(n, generator=g))  # scales over about two orders of magnitude

    with torch.no_grad():
        for layer in loaded.model.model.layers:
            fold_qkv(layer, rand(arch.hidden_size))
            if arch.kv_size == arch.q_size:
                fold_o(layer, arch, rand(arch.q_size))
            fold_gate_up(layer, rand(arch.hidden_size))
            fold_down(layer, arch, rand(arch.intermediate_size))
    torch.testing.assert_close(_logits(loaded, tokens), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama_mha_tied", "qwen2_gqa"])
def test_checkpoint_follows_the_format_and_runs_packed(tiny_models, tmp_path, name: str) -> None:
    tiny = tiny_models[name]
    out = tmp_path / "q"
    vocab = tiny.hf.config.vocab_size
    settings = AWQSettings(group_size=32, scaling="both" if name == "qwen2_gqa" else "activation")
    result = write_awq_checkpoint(str(tiny.path), str(out), settings, _windows(vocab), calibration="random ids")
    assert (name == "qwen2_gqa") or not any(result.report.duo.values())
    assert result.report.o_proj_scaled == (name == "llama_mha_tied")  # GQA: o_proj keeps s = 1, as AutoAWQ
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["meta"]["scaling"] == settings.scaling
    assert qc["meta"]["scaled_groups"] == len(result.report.duo) > 0
    assert qc["meta"]["duo_groups"] == sum(result.report.duo.values())
    assert {k: qc[k] for k in ("quant_method", "version", "bits", "group_size", "zero_point")} == {
        "quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True}
    h, inter = tiny.hf.config.hidden_size, tiny.hf.config.intermediate_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert not any(n.endswith("_proj.weight") for n in names) and not any(n.endswith("g_idx") for n in names)
        prefix = "model.layers.1.mlp.up_proj"
        t = {k: f.get_tensor(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales")}
        down = {k: f.get_tensor(f"model.layers.1.mlp.down_proj.{k}") for k in ("qweight", "qzeros", "scales")}
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (h, inter // 8)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (h // 32, inter // 8)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (h // 32, inter)
    assert down["qweight"].shape == (inter, h // 8) and down["scales"].shape == (inter // 32, h)
    from_checkpoint(t)  # decodes

    loaded = load_model(str(out), torch.float32, CPU)  # quantization "awq" by default
    layer = loaded.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(lin.quant_method, AWQLinearMethod)
        assert lin.dense_weight is None and lin.packed[0].layout in Q4_LAYOUTS and lin.input_perm is None
    assert not isinstance(loaded.model.lm_head.quant_method, AWQLinearMethod)
    assert "AWQ 4-bit" in loaded.model.weight_report()["qkv_proj"][0]

    tokens = _windows(vocab, 1, 32, seed=9)[0]
    ours = _logits(loaded, tokens)
    assert _kl(hf_logits(tiny.hf, tokens), ours) < 0.2  # random weights: no outliers to spare
    # the packed model computes what the quantized weights say (the dense model they were written from)
    dense = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    quantize_model_awq(dense.model, dense.arch, settings, _windows(vocab))
    torch.testing.assert_close(ours, _logits(dense, tokens), rtol=1e-3, atol=2e-2)  # float16 min = -zero*scale


def test_awq_beats_rtn_and_runs_through_llm(tiny_models, tmp_path) -> None:
    from loom import LLM, SamplingParams
    from loom.model.loader import load_tokenizer

    tiny = tiny_models["llama_mha_tied"]
    vocab = tiny.hf.config.vocab_size
    source = tmp_path / "src"  # the tiny model with a tokenizer, for the engine
    shutil.copytree(tiny.path, source)
    load_tokenizer(None).save_pretrained(str(source))
    calib = _windows(vocab, 6, 64, seed=1)
    outs = {"awq": tmp_path / "awq", "rtn": tmp_path / "rtn"}
    write_awq_checkpoint(str(source), str(outs["awq"]), AWQSettings(group_size=32), calib)
    # RTN on the same grid and format: alpha 0 only (s = 1), no clipping
    write_awq_checkpoint(str(source), str(outs["rtn"]), AWQSettings(group_size=32, clip=False, grid_points=1), calib)
    held_out = _windows(vocab, 3, 48, seed=2)
    kl = {m: sum(_kl(hf_logits(tiny.hf, w), _logits(load_model(str(p), torch.float32, CPU), w)) for w in held_out)
          for m, p in outs.items()}
    assert kl["awq"] < kl["rtn"]

    prompts = [w[:12] for w in held_out]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    llm = LLM(model=str(outs["awq"]), dtype="float32")  # quantization "awq" by default
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(g) == 8 for g in got)
    first = [int(hf_logits(tiny.hf, p)[-1].argmax()) for p in prompts]  # the float model's first greedy token
    assert sum(f == g[0] for f, g in zip(first, got, strict=True)) >= 2  # 4-bit random weights part soon


def test_refusals(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    out = tmp_path / "q"
    write_awq_checkpoint(str(tiny.path), str(out), AWQSettings(group_size=32, grid_points=2),
                         _windows(tiny.hf.config.vocab_size, 1, 16))
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(out), torch.float32, CPU, quantization="w4a16")
    with pytest.raises(ValueError, match="needs an AWQ checkpoint"):
        load_model(str(tiny.path), torch.float32, CPU, quantization="awq")
    with pytest.raises(ValueError, match="calibration window"):
        write_awq_checkpoint(str(tiny.path), str(tmp_path / "x"), AWQSettings(group_size=32), [])
    with pytest.raises(ValueError, match="group_size"):
        AWQSettings(group_size=48).check()
    with pytest.raises(ValueError, match="scaling must be one of"):
        AWQSettings(scaling="weights").check()
    from loom.quant.quantize import quantize

    with pytest.raises(ValueError, match="bits must be 4 for awq"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", bits=8)
    with pytest.raises(ValueError, match="awq_scaling must be one of"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", awq_scaling="nope")
    assert not (tmp_path / "y").exists()
    with pytest.raises(ValueError, match="group_size"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", group_size=-1)


def test_cli_passes_the_scaling_and_reports_what_the_search_chose(tmp_path, capsys, monkeypatch) -> None:
    """`loom quantize --method awq --awq-scaling duo` reaches quantize() as awq_scaling, and the closing line says
    how many groups the duo formula won (the fresh-user trial found no way to tell)."""
    import loom.quant.quantize as q
    from loom.cli import main

    seen = {}

    def fake(model, output, method, **kw):
        seen.update(kw, method=method)
        qc = {"group_size": 128, "meta": {"scaling": kw["awq_scaling"], "duo_groups": 3, "scaled_groups": 8}}
        return q.QuantizeResult(tmp_path / "out", "awq", "random ids", 64, None, 1.0, qc)

    monkeypatch.setattr(q, "quantize", fake)
    assert main(["quantize", "--method", "awq", "--awq-scaling", "duo", "--output", str(tmp_path / "out")]) == 0
    assert seen["method"] == "awq" and seen["awq_scaling"] == "duo"
    assert "scaling duo: duo won 3 of 8 groups" in capsys.readouterr().out
