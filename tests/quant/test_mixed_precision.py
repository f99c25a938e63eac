"""Mixed precision (loom/quant/mixed.py): ZeroQ sensitivity, the allocation under a bit budget, and GPTQ
checkpoints with per-module `dynamic` overrides written and loaded."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from loom.model.loader import load_model
from loom.quant import mixed
from loom.quant.gptq_checkpoint import GPTQSettings, write_gptq_checkpoint
from loom.quant.gptq_method import GPTQLinearMethod, read_dynamic
from loom.quant.mixed import DENSE, Unit

CPU = torch.device("cpu")


def _windows(vocab: int, n: int = 3, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def test_format_bits_count_scales_and_zeros() -> None:
    assert mixed.format_bits((4, 128), 512) == pytest.approx(4 + 20 / 128)
    assert mixed.format_bits((4, 128), 576) == pytest.approx(4 + 5 * 20 / 576)  # 4 groups of 128 and one of 64
    assert mixed.format_bits((4, 32), 576) == pytest.approx(4 + 20 / 32)
    assert mixed.format_bits((8, -1), 512) == pytest.approx(8 + 24 / 512)
    assert mixed.format_bits(DENSE, 576) == 16.0


def test_allocation_spends_the_budget_on_kl_per_bit() -> None:
    units = [Unit(f"u{i}", (f"u{i}",), 1000, 128) for i in range(4)]
    base, wide = (4, 128), (8, 128)
    kl = {("u0", base): 0.5, ("u1", base): 0.1, ("u2", base): 0.01, ("u3", base): 0.3}
    kl |= {(f"u{i}", wide): 0.001 for i in range(4)}
    b4, b8 = (mixed.unit_bits(units[0], f) / 1000 for f in (base, wide))  # per weight, g_idx included
    assert b4 == pytest.approx(4 + 20 / 128 + 32 * 128 / 1000)
    # room for exactly two upgrades to 8 bits: the two largest KL drops per bit (u0, u3)
    target = (2 * b8 + 2 * b4) / 4
    plan = mixed.allocate(units, kl, base, [wide, DENSE], target + 1e-9)
    assert plan == {"u0": wide, "u1": base, "u2": base, "u3": wide}
    assert mixed.plan_bits(units, plan) <= target + 1e-9
    # the base format's own size is the floor
    assert mixed.allocate(units, kl, base, [wide, DENSE], b4) == {f"u{i}": base for i in range(4)}
    with pytest.raises(ValueError, match="target_bits 4.0 is below"):
        mixed.allocate(units, kl, base, [wide], 4.0)
    # a generous budget buys 16 bits (KL 0) for every unit
    assert set(mixed.allocate(units, kl, base, [wide, DENSE], 16.0).values()) == {DENSE}


def test_dynamic_config_round_trips_through_the_loader_rules() -> None:
    units = [Unit("model.layers.0.self_attn.qkv_proj", ("model.layers.0.self_attn.q_proj",
                  "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"), 10, 64),
             Unit("model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",), 10, 64),
             Unit("model.layers.1.mlp.down_proj", ("model.layers.1.mlp.down_proj",), 10, 64)]
    plan = {units[0].name: DENSE, units[1].name: (8, 32), units[2].name: (4, 128)}
    dynamic = mixed.dynamic_config(units, plan, (4, 128))
    assert len(dynamic) == 2  # the unit in the base format needs no pattern
    from loom.quant.gptq_method import GPTQCheckpoint

    ckpt = GPTQCheckpoint(4, "gptq", frozenset(), read_dynamic(dynamic))
    for name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        assert ckpt.bits_of(f"model.layers.0.self_attn.{name}") is None
    assert ckpt.bits_of("model.layers.0.mlp.down_proj") == 8
    assert ckpt.bits_of("model.layers.10.mlp.down_proj") == 4  # anchored: layer 1's pattern is not layer 10's
    assert ckpt.bits_of("model.layers.1.mlp.down_proj") == 4


@pytest.mark.parametrize(("dynamic", "message"), [
    ([1], "must be an object of pattern"),
    ({"+:(": {"bits": 8}}, "not a regular expression"),
    ({"+:.*": {"bits": 3}}, "bits must be one of"),
    ({"+:.*": 8}, "must be an object of overrides"),
])
def test_bad_dynamic_is_a_clear_error(dynamic, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_dynamic(dynamic)


def test_sensitivity_is_the_kl_of_one_quantized_layer(tiny_models) -> None:
    tiny = tiny_models["llama_gqa"]
    dense = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    before = {k: v.clone() for k, v in dense.model.state_dict().items()}
    windows = _windows(tiny.hf.config.vocab_size, 2)
    sens = mixed.layer_sensitivity(dense.model, dense.arch, windows, [(4, 32), (8, 32)], sym=True)
    units = mixed.units_of(dense.model)
    assert {name for name, _ in sens} == {u.name for u in units}
    for u in units:  # 8 bits perturbs far less than 4 bits, and both perturb
        assert 0 < sens[(u.name, (8, 32))] < sens[(u.name, (4, 32))]
    for k, v in dense.model.state_dict().items():  # weights restored
        assert torch.equal(v, before[k]), k
    # one unit by hand: quantize only it, compare the whole model's distributions
    from loom.bench.quality import window_logits
    from loom.quant.gptq import rtn_quantize

    name = units[3].name
    lin = dense.model.get_submodule(name)
    ref = [torch.log_softmax(window_logits(dense.model, dense.arch, w), -1) for w in windows]
    lin.weight.data.copy_(rtn_quantize(lin.weight.data, 4, 32, True).dequantize())
    lq = [torch.log_softmax(window_logits(dense.model, dense.arch, w), -1) for w in windows]
    by_hand = sum(float((r.exp() * (r - q)).sum()) for r, q in zip(ref, lq)) / sum(len(w) for w in windows)
    assert sens[(name, (4, 32))] == pytest.approx(by_hand, rel=1e-3)


def test_target_bits_writes_a_mixed_checkpoint_that_loads_and_beats_uniform(tiny_models, tmp_path) -> None:
    from loom.bench.quality import compare, window_logits

    tiny = tiny_models["llama_gqa"]
    vocab = tiny.hf.config.vocab_size
    calib = _windows(vocab, 4, 48, seed=1)
    uniform, mix = tmp_path / "uniform", tmp_path / "mixed"
    write_gptq_checkpoint(str(tiny.path), str(uniform), GPTQSettings("rtn", 4, 32, True, False), calib)
    override = {"-:^model\\.layers\\.0\\.self_attn\\.(q|k|v)_proj$": {}}
    result = write_gptq_checkpoint(
        str(tiny.path), str(mix), GPTQSettings("rtn", 4, 32, True, False, target_bits=7.5, dynamic=override),
        calib, calibration="random ids")
    assert 7.0 < result.bits_per_weight <= 7.5
    from loom.bench.quant_report import checkpoint_linear_bits

    # the budget is the file's own bytes: codes, scales, zeros, g_idx, float16 layers
    assert checkpoint_linear_bits(mix) == pytest.approx(result.bits_per_weight, rel=1e-6)
    qc = json.loads((mix / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 4 and qc["meta"]["target_bits"] == 7.5
    assert next(iter(qc["dynamic"])) == next(iter(override))  # the user's override first
    assert any(k.startswith("+:") and v["bits"] == 8 for k, v in qc["dynamic"].items())
    with safe_open(str(mix / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float16
    assert "model.layers.0.self_attn.q_proj.qweight" not in names
    loaded = load_model(str(mix), torch.float32, CPU)  # gptq by default; per-module bits from dynamic
    qkv0 = loaded.model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(qkv0.quant_method, GPTQLinearMethod)
    bits = {loaded.model.get_submodule(f"model.layers.{i}.{p}").quant_method.bits
            for i in range(len(loaded.model.model.layers))
            for p in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert bits == {4, 8}
    ref = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    held = _windows(vocab, 3, 48, seed=5)
    base = [window_logits(ref.model, ref.arch, w) for w in held]

    def kl(path) -> float:
        m = load_model(str(path), torch.float32, CPU)
        return compare(base, [window_logits(m.model, m.arch, w) for w in held], held)["mean_kl"]

    assert kl(mix) < 0.5 * kl(uniform)


def test_target_bits_that_the_overrides_already_spend_is_named(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    settings = GPTQSettings("rtn", 4, 32, True, False, target_bits=5.5, dynamic={"-:.*\\.mlp\\..*": {}})
    with pytest.raises(ValueError, match="the layers dynamic sets leave"):
        write_gptq_checkpoint(str(tiny.path), str(tmp_path / "x"), settings, [[1, 2, 3, 4]])


def test_dynamic_that_splits_stacked_projections_is_refused(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    settings = GPTQSettings("rtn", 4, 32, True, False, dynamic={"+:.*\\.q_proj$": {"bits": 8}})
    with pytest.raises(ValueError, match="run as one matrix"):
        write_gptq_checkpoint(str(tiny.path), str(tmp_path / "x"), settings, [])


def test_wider_formats_are_estimated_from_the_measured_one() -> None:
    sens = {("a", (4, 128)): 0.32, ("a", (4, 32)): 0.1, ("b", (4, 128)): 0.064}
    est = mixed.estimate_wider(sens, (4, 128), (8, 128))
    assert est == {("a", (8, 128)): pytest.approx(0.32 / 256), ("b", (8, 128)): pytest.approx(0.064 / 256)}
    with pytest.raises(ValueError, match="same groups"):
        mixed.estimate_wider(sens, (4, 128), (8, 32))


def test_a_dynamic_bits_override_that_disagrees_with_the_file_is_named(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    out = tmp_path / "m"
    dynamic = {"+:^model\\.layers\\.1\\.mlp\\.down_proj$": {"bits": 8}}
    write_gptq_checkpoint(str(tiny.path), str(out), GPTQSettings("rtn", 4, 32, True, False, dynamic=dynamic), [])
    assert load_model(str(out), torch.float32, CPU).model.model.layers[1].mlp.down_proj.quant_method.bits == 8
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["dynamic"]  # the file's 8-bit layer now claims the base 4 bits
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: qweight has .* at 4 bits"):
        load_model(str(out), torch.float32, CPU)


def test_dynamic_mistakes_are_named_before_any_work(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    cases = [
        (GPTQSettings("rtn", 4, 32, True, False, dynamic={"+:.*embed_tokens": {"bits": 8}}), "matches none"),
        (GPTQSettings("rtn", 4, 32, True, False, target_bits=6.0, dynamic={"-:.*": {}}), "already take 16.000"),
    ]
    for i, (settings, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            write_gptq_checkpoint(str(tiny.path), str(tmp_path / str(i)), settings, [[1, 2, 3, 4]])


def test_cli_reads_inline_json_lists_as_json_and_names_hidden_leftovers(tmp_path) -> None:
    import subprocess
    import sys

    run = [sys.executable, "-m", "loom.cli", "quantize", "--method", "rtn"]
    proc = subprocess.run([*run, "--dynamic", "[1]", "--output", str(tmp_path / "a")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "must be a JSON object" in proc.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".tmpXYZ").write_text("partial")
    proc = subprocess.run([*run, "--output", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "only hidden files, .tmpXYZ" in proc.stderr
