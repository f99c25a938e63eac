"""`loom quantize --method awq`: folding exact before rounding, AutoAWQ gemm checkpoints written, loaded by loom's
AWQ loader into q4g, run end to end."""

from __future__ import annotations

import json
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
from tests.quant.checkpoint_harness import kl as _kl
from tests.quant.checkpoint_harness import logits as _logits
from tests.quant.checkpoint_harness import windows as _windows

CPU = torch.device("cpu")


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
    # the default clipping, "auto": what it scored and chose is in the meta
    assert qc["meta"]["clip"] == "auto" and qc["meta"]["clipped"] == list(result.report.clipped)
    assert {"none", "qkv", "o", "gate_up", "down", "all"} <= set(qc["meta"]["clip_scores"])
    assert qc["meta"]["clip_scores"]["none"] == result.report.clip_scores["none"]._asdict()
    assert qc["meta"]["clip_windows"] == 2 and qc["meta"]["clip_held_out"]  # _windows(vocab): 4, the search reads 2
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
    # clipping "on", the paper's: "auto" weighs next-token NLL, which random tokens on random weights make noise
    write_awq_checkpoint(str(source), str(outs["awq"]), AWQSettings(group_size=32, clip="on"), calib)
    # RTN on the same grid and format: alpha 0 only (s = 1), no clipping
    write_awq_checkpoint(str(source), str(outs["rtn"]), AWQSettings(group_size=32, clip="off", grid_points=1), calib)
    held_out = _windows(vocab, 3, 48, seed=2)
    kl = {m: sum(_kl(hf_logits(tiny.hf, w), _logits(load_model(str(p), torch.float32, CPU), w)) for w in held_out)
          for m, p in outs.items()}
    assert kl["awq"] < kl["rtn"]
    meta = json.loads((outs["awq"] / "config.json").read_text())["quantization_config"]["meta"]
    assert meta["clip"] == "on" and meta["clipped"] == ["qkv", "o", "gate_up", "down"] and meta["clip_scores"] == {}

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
    with pytest.raises(ValueError, match="clip must be one of auto, on, off, got True"):
        AWQSettings(clip=True).check()
    with pytest.raises(ValueError, match="loss must be one of mse, normalized, got 'l1'"):
        AWQSettings(loss="l1").check()
    from loom.quant.quantize import quantize

    with pytest.raises(ValueError, match="bits must be 4 for awq"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", bits=8)
    with pytest.raises(ValueError, match="awq_scaling must be one of"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", awq_scaling="nope")
    with pytest.raises(ValueError, match="awq_clip must be one of auto, on, off, got 'sometimes'"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", awq_clip="sometimes")
    with pytest.raises(ValueError, match="awq_loss must be one of mse, normalized, got 'l1'"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", awq_loss="l1")
    with pytest.raises(ValueError, match="lm_head_bits applies to awq with target_bits"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", lm_head_bits=8)
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
        qc = {"group_size": 128, "meta": {"scaling": kw["awq_scaling"], "duo_groups": 3, "scaled_groups": 8,
                                          "loss": kw["awq_loss"], "clip": kw["awq_clip"], "clipped": ["qkv", "down"],
                                          "clip_windows": 6, "clip_held_out": True}}
        return q.QuantizeResult(tmp_path / "out", "awq", "random ids", 64, None, 1.0, qc)

    monkeypatch.setattr(q, "quantize", fake)
    assert main(["quantize", "--method", "awq", "--awq-scaling", "duo", "--awq-clip", "auto", "--awq-loss",
                 "normalized", "--output", str(tmp_path / "out")]) == 0
    assert seen["method"] == "awq" and seen["awq_scaling"] == "duo" and seen["awq_clip"] == "auto"
    assert seen["awq_loss"] == "normalized"
    assert ("scaling duo, loss normalized: duo won 3 of 8 groups, clip auto: qkv+down clipped (chosen on 6 "
            "held-out calibration windows)" in capsys.readouterr().out)
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--method", "awq", "--awq-clip", "sometimes", "--output", str(tmp_path / "out")])
    assert exc.value.code == 2 and "--awq-clip" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama_mha_tied", "qwen2_gqa"])
def test_auto_clip_keeps_the_candidate_it_scored_best(tiny_models, name: str) -> None:
    """clip "auto" scores none / each type / all on the windows the scale search did not read, against the
    unquantized model, and keeps the lowest KL among those no worse in NLL than none; the model it leaves is the
    chosen candidate's (it scores the same), and "none" and "all" are exactly what clip "off" and "on" produce."""
    from loom.quant.awq_model import _score, log_probs

    tiny = tiny_models[name]
    calib = _windows(tiny.hf.config.vocab_size, 4, 48, seed=3)
    held_out = calib[2:]  # search_windows = 2
    reference, got = None, {}
    for clip in ("auto", "on", "off"):
        m = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
        if reference is None:
            reference = log_probs(m.model, m.arch, held_out)
        _, report = quantize_model_awq(m.model, m.arch, AWQSettings(group_size=32, grid_points=4, clip=clip), calib)
        got[clip] = _score(m.model, m.arch, held_out, reference)
        if clip == "auto":
            scores = report.clip_scores
            assert list(scores)[:5] == ["none", "qkv", "o", "gate_up", "down"] and "all" in scores
            chosen = "all" if report.clipped == ("qkv", "o", "gate_up", "down") else "+".join(report.clipped) or "none"
            eligible = [s.kl for s in scores.values() if s.nll <= scores["none"].nll]
            assert scores[chosen].kl == min(eligible) and scores[chosen].nll <= scores["none"].nll
            assert got["auto"] == pytest.approx(scores[chosen], rel=1e-9, abs=0)
        else:
            assert report.clipped == (("qkv", "o", "gate_up", "down") if clip == "on" else ())
            assert not report.clip_scores
    assert got["off"] == pytest.approx(scores["none"], rel=1e-9, abs=0)
    assert got["on"] == pytest.approx(scores["all"], rel=1e-9, abs=0)


def test_select_clip_keeps_the_closest_candidate_that_costs_no_perplexity(monkeypatch) -> None:
    """The candidates and the choice, with the scorer replaced by a table (clipped types -> (nll, kl)): the types
    that improved both measures alone are scored together; a candidate with a higher NLL than none's is never
    chosen, however low its KL; ties go to the earlier candidate."""
    import loom.quant.awq_model as am

    state = {"clipped": ()}
    monkeypatch.setattr(am, "_quantize_layer", lambda layer, arch, w, b, clipped, g: state.update(clipped=clipped))
    calls = []

    def table(values):
        def score(model, arch, windows, reference):
            calls.append(state["clipped"])
            return am.ClipScore(*values.get(state["clipped"], (9.0, 9.0)))
        return score

    def select():
        return am.select_clip(None, None, [(None, {}, {})], [[1, 2]], [], 32)

    # o and down improve both; qkv lowers KL most but costs NLL; the union of o and down is best
    monkeypatch.setattr(am, "_score", table({(): (3.0, 0.30), ("qkv",): (3.1, 0.10), ("o",): (2.9, 0.29),
                                             ("down",): (3.0, 0.28), ("o", "down"): (2.95, 0.25),
                                             am.CLIP_TYPES: (3.2, 0.05)}))
    best, scores = select()
    assert best == ("o", "down") and scores["o+down"] == (2.95, 0.25) and scores["all"] == (3.2, 0.05)
    assert calls == [(), ("qkv",), ("o",), ("gate_up",), ("down",), ("o", "down"), am.CLIP_TYPES]
    # one type helps: no separate union; every other candidate costs NLL
    monkeypatch.setattr(am, "_score", table({(): (3.0, 0.30), ("gate_up",): (3.0, 0.2)}))
    best, scores = select()
    assert best == ("gate_up",) and list(scores) == ["none", "qkv", "o", "gate_up", "down", "all"]
    # nothing helps: none; a tie in KL goes to the earlier candidate
    monkeypatch.setattr(am, "_score", table({(): (3.0, 0.30), am.CLIP_TYPES: (3.0, 0.30)}))
    assert select()[0] == ()


@pytest.mark.parametrize("loss", ["mse", "normalized"])
def test_loss_setting_reaches_every_group_s_search(tiny_models, monkeypatch, loss: str) -> None:
    """AWQSettings.loss "normalized" wraps each scale search's block (q/k/v, o where scaled, gate/up, down) in
    awq.normalized_loss; "mse" leaves the paper's error."""
    import loom.quant.awq_model as am

    wrapped = []
    real = am.normalized_loss
    monkeypatch.setattr(am, "normalized_loss", lambda block: wrapped.append(block) or real(block))
    tiny = tiny_models["llama_mha_tied"]  # kv_size == q_size: o_proj is scaled too
    m = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    _, report = quantize_model_awq(m.model, m.arch, AWQSettings(group_size=32, grid_points=2, clip="off", loss=loss),
                                   _windows(tiny.hf.config.vocab_size, 2, 32))
    assert len(wrapped) == (len(report.alphas) if loss == "normalized" else 0) and len(report.alphas) == 4 * len(
        m.model.model.layers)


def test_auto_clip_with_no_window_left_scores_the_searched_ones_and_says_so(tiny_models, caplog) -> None:
    """With no more calibration windows than the scale search reads, "auto" scores on those windows; the report
    (and so the checkpoint's meta and the CLI's last line) says they were not held out, and a warning says why
    (a fresh-user trial found the log calling them held-out)."""
    import logging

    tiny = tiny_models["llama_gqa"]
    m = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    with caplog.at_level(logging.INFO, logger="loom.quant.awq_model"):
        _, report = quantize_model_awq(m.model, m.arch, AWQSettings(group_size=32, grid_points=2),
                                       _windows(tiny.hf.config.vocab_size, 1, 32))
    assert report.clip_windows == 1 and not report.clip_held_out and report.clip_scores
    assert "not held-out ones" in caplog.text and "held-out calibration" not in caplog.text


def test_awq_target_bits_below_the_base_format_is_refused_before_the_search(tiny_models, tmp_path,
                                                                            monkeypatch) -> None:
    from loom.quant import awq_checkpoint
    from loom.quant.gptq_checkpoint import GPTQSettings

    def searched(*_a, **_k):
        raise AssertionError("the AWQ search ran before the budget was checked")

    monkeypatch.setattr(awq_checkpoint, "quantize_model_awq", searched)
    tiny = tiny_models["llama_gqa"]
    with pytest.raises(ValueError, match="target_bits 3.0 is below the"):
        awq_checkpoint.write_awq_mixed_checkpoint(
            str(tiny.path), str(tmp_path / "q"), AWQSettings(group_size=32),
            GPTQSettings("rtn", 4, 32, False, False, target_bits=3.0), _windows(tiny.hf.config.vocab_size, 1, 16))
    assert not (tmp_path / "q").exists() or not any((tmp_path / "q").iterdir())


def test_awq_with_target_bits_writes_a_mixed_gptq_checkpoint(tmp_path) -> None:
    """`--method awq --target-bits`: AWQ's scales folded, then the mixed-precision allocation on the scaled model.
    The file is GPTQ-format with per-layer `dynamic` overrides; the layers left in the base format hold exactly
    AWQ's own 4-bit weights (codes, scales, zeros of quantize_model_awq on the same windows), the upgraded ones the
    scaled weights by RTN in their format, the norms AWQ's folded ones; it loads packed, and at a larger budget it is
    closer to the source than AWQ alone."""
    from transformers import LlamaConfig

    from loom.quant.awq_checkpoint import write_awq_mixed_checkpoint
    from loom.quant.gptq import rtn_quantize
    from loom.quant.gptq_checkpoint import GPTQSettings
    from loom.quant.gptq_format import from_checkpoint as gptq_from_checkpoint
    from tests.model.model_harness import save_tiny_model

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny_model(config, tmp_path / "hf", seed=3)
    windows = _windows(128, 6, 48)
    awq = AWQSettings(group_size=64)
    mixed = GPTQSettings("rtn", 4, 64, False, False, target_bits=4.9, lm_head_bits=8)
    r = write_awq_mixed_checkpoint(str(tmp_path / "hf"), str(tmp_path / "q"), awq, mixed, windows)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["meta"]["method"] == "awq" and qc["lm_head"] is True
    layer_rules = [k for k in qc["dynamic"] if k != "+:lm_head"]
    assert layer_rules and r.bits_per_weight <= 4.9 + 1e-6

    # the same AWQ run in memory: its 4-bit weights, its scaled floats, its folded norms
    reference = load_model(str(tmp_path / "hf"), torch.float32, CPU, quantization="none")
    scaled: dict[str, torch.Tensor] = {}
    awq_weights, _ = quantize_model_awq(reference.model, reference.arch, awq, windows, scaled)
    fmt = qc["checkpoint_format"]
    loaded = load_model(str(tmp_path / "q"), torch.float32, CPU)
    base = upgraded = 0
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as f:
        for i in range(2):
            p = f"model.layers.{i}"
            assert torch.equal(f.get_tensor(f"{p}.input_layernorm.weight"),
                               reference.model.model.layers[i].input_layernorm.weight.float())
            for proj, unit, rows in (("q_proj", "self_attn.qkv_proj", slice(0, 128)), ("o_proj", "self_attn.o_proj",
                                     slice(None)), ("down_proj", "mlp.down_proj", slice(None))):
                t = {k: f.get_tensor(f"{p}.self_attn.{proj}.{k}" if "proj" in proj and "down" not in proj
                                     else f"{p}.mlp.{proj}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
                stored = gptq_from_checkpoint(t, 8 if t["qweight"].shape[0] * 4 == t["g_idx"].shape[0] else 4, fmt)
                name = f"{p}.{unit}"
                own = awq_weights[name]
                if stored.bits == 4 and stored.scales.shape[0] == own.scales.shape[0]:  # the base format
                    assert torch.equal(stored.codes, own.codes[rows]) and torch.equal(stored.zeros, own.zeros[:, rows])
                    base += 1
                else:  # an upgrade: RTN of AWQ's scaled weights in that format
                    group = 128 // stored.scales.shape[0]
                    want = rtn_quantize(scaled[name][rows], stored.bits, group, False)
                    assert torch.equal(stored.codes, want.codes) and torch.equal(stored.scales, want.scales)
                    upgraded += 1
    assert base and upgraded
    tokens = _windows(128, 1, 32, seed=9)[0]
    source = load_model(str(tmp_path / "hf"), torch.float32, CPU, quantization="none")
    uniform = tmp_path / "u"
    write_awq_checkpoint(str(tmp_path / "hf"), str(uniform), awq, windows)
    ref = _logits(source, tokens)
    assert _kl(ref, _logits(loaded, tokens)) < _kl(ref, _logits(load_model(str(uniform), torch.float32, CPU), tokens))


def _tiny_llama(tmp_path):
    from transformers import LlamaConfig

    from tests.model.model_harness import save_tiny_model

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny_model(config, tmp_path / "hf", seed=3)
    return tmp_path / "hf"


def _held_out_kl(source, checkpoint, seeds=(9, 10, 11)) -> float:
    model = load_model(str(source), torch.float32, CPU, quantization="none")
    quantized = load_model(str(checkpoint), torch.float32, CPU)
    return sum(_kl(_logits(model, w), _logits(quantized, w)) for s in seeds for w in _windows(128, 1, 48, seed=s))


@pytest.mark.parametrize("desc_act", [False, True])
def test_awq_with_gptq_rounding_is_gptq_of_the_scaled_model(tmp_path, desc_act: bool) -> None:
    """`--method awq --weight-rounding gptq` (llm-compressor's AWQ + GPTQ): the file holds AWQ's folded norms and,
    for every projection, GPTQ's codes, scales and zeros of AWQ's scaled (unclipped) weights on the same
    calibration windows, in AutoAWQ's format; on held-out tokens it is closer to the source than AWQ's own
    rounding without clipping. With desc_act, GPTQ runs in act order over static groups (contiguous, as the format
    needs)."""
    from loom.quant.gptq_checkpoint import GPTQSettings, quantize_model_weights

    hf = _tiny_llama(tmp_path)
    windows = _windows(128, 16, 64)  # GPTQ needs a Hessian of some tokens per input column to beat RTN
    awq = AWQSettings(group_size=64, clip="off")
    write_awq_checkpoint(str(hf), str(tmp_path / "g"), awq, windows, weight_rounding="gptq", desc_act=desc_act)
    write_awq_checkpoint(str(hf), str(tmp_path / "r"), awq, windows)
    qc = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["meta"]["weight_rounding"] == "gptq" and qc["meta"]["clipped"] == []
    assert qc["meta"]["desc_act"] is desc_act

    reference = load_model(str(hf), torch.float32, CPU, quantization="none")
    scaled: dict[str, torch.Tensor] = {}
    quantize_model_awq(reference.model, reference.arch, awq, windows, scaled)
    for name, w in scaled.items():
        reference.model.get_submodule(name).weight.data.copy_(w)
    want = quantize_model_weights(reference.model, reference.arch,
                                  GPTQSettings("gptq", 4, 64, False, desc_act, static_groups=desc_act), windows)
    with safe_open(str(tmp_path / "g" / "model.safetensors"), framework="pt") as f:
        for i in range(2):
            p = f"model.layers.{i}"
            assert torch.equal(f.get_tensor(f"{p}.post_attention_layernorm.weight"),
                               reference.model.model.layers[i].post_attention_layernorm.weight.float())
            for proj, unit, rows in (("self_attn.k_proj", "self_attn.qkv_proj", slice(128, 192)),
                                     ("mlp.down_proj", "mlp.down_proj", slice(None))):
                t = {k: f.get_tensor(f"{p}.{proj}.{k}") for k in ("qweight", "qzeros", "scales")}
                stored = from_checkpoint(t, 64)
                q = want[f"{p}.{unit}"]
                assert torch.equal(stored.codes, q.codes[rows]) and torch.equal(stored.zeros, q.zeros[:, rows])
                assert torch.equal(stored.scales, q.scales[:, rows].half())
    assert _held_out_kl(hf, tmp_path / "g") < _held_out_kl(hf, tmp_path / "r")


@pytest.mark.parametrize("desc_act", [False, True])
def test_awq_mixed_with_gptq_rounding_rounds_every_layer_by_gptq(tmp_path, desc_act: bool) -> None:
    """`--method awq --target-bits B --weight-rounding gptq`: the same allocation as with AWQ's own rounding (it is
    measured on the scaled model before any rounding), every layer, base ones included, GPTQ of the scaled weights
    in its format, and closer to the source on held-out tokens than the RTN-rounded mixed file."""
    from loom.quant.awq_checkpoint import write_awq_mixed_checkpoint
    from loom.quant.gptq_checkpoint import GPTQSettings

    hf = _tiny_llama(tmp_path)
    windows = _windows(128, 16, 64)  # GPTQ needs a Hessian of some tokens per input column to beat RTN
    files = {}
    for rounding, clip in (("gptq", "off"), ("rtn", "off")):
        act = desc_act and rounding == "gptq"  # act order over static groups, GPTQ-format file with plain g_idx
        mixed = GPTQSettings(rounding, 4, 64, False, act, target_bits=4.9, lm_head_bits=8, static_groups=act)
        r = write_awq_mixed_checkpoint(str(hf), str(tmp_path / rounding), AWQSettings(group_size=64, clip=clip),
                                       mixed, windows)
        assert r.bits_per_weight <= 4.9 + 1e-6
        files[rounding] = json.loads((tmp_path / rounding / "config.json").read_text())["quantization_config"]
    assert files["gptq"]["dynamic"] == files["rtn"]["dynamic"] and files["gptq"]["dynamic"]
    assert files["gptq"]["meta"]["weight_rounding"] == "gptq" and files["rtn"]["meta"]["weight_rounding"] == "rtn"
    assert files["gptq"]["desc_act"] is desc_act
    assert _held_out_kl(hf, tmp_path / "gptq") < _held_out_kl(hf, tmp_path / "rtn")


def test_awq_gptq_rounding_refusals(tiny_models, tmp_path, monkeypatch) -> None:
    from loom.quant import awq_checkpoint
    from loom.quant.awq_checkpoint import write_awq_mixed_checkpoint
    from loom.quant.gptq_checkpoint import GPTQSettings
    from loom.quant.quantize import quantize

    def searched(*_a, **_k):
        raise AssertionError("the AWQ search ran before the settings were checked")

    tiny = tiny_models["llama_gqa"]
    windows = _windows(tiny.hf.config.vocab_size, 1, 16)
    with pytest.raises(ValueError, match="awq_clip applies to awq's own rounding"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", weight_rounding="gptq", awq_clip="on")
    # clip "off" given explicitly is what gptq rounding runs: past that check, the next refusal is the bits'
    with pytest.raises(ValueError, match="bits must be 4 for awq"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", weight_rounding="gptq", awq_clip="off", bits=8)
    with pytest.raises(ValueError, match="damp_percent applies to awq with weight_rounding 'gptq'"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", damp_percent=0.1)
    monkeypatch.setattr(awq_checkpoint, "quantize_model_awq", searched)
    with pytest.raises(ValueError, match="damp_percent must be in"):  # GPTQ's own check, before the search
        write_awq_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32, clip="off"), windows,
                             weight_rounding="gptq", damp_percent=1.5)
    with pytest.raises(ValueError, match="takes clip 'off'"):
        write_awq_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32), windows,
                             weight_rounding="gptq")
    with pytest.raises(ValueError, match="weight_rounding must be 'rtn' or 'gptq', got 'awq'"):
        write_awq_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32), windows,
                             weight_rounding="awq")
    with pytest.raises(ValueError, match="takes clip 'off'"):
        write_awq_mixed_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32),
                                   GPTQSettings("gptq", 4, 32, False, False, target_bits=5.0), windows)
    with pytest.raises(ValueError, match="act order only by gptq with static groups"):
        write_awq_mixed_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32, clip="off"),
                                   GPTQSettings("gptq", 4, 32, False, True, target_bits=5.0), windows)
    with pytest.raises(ValueError, match="desc_act applies to awq with weight_rounding 'gptq'"):
        quantize(str(tiny.path), str(tmp_path / "y"), "awq", desc_act=True)
    with pytest.raises(ValueError, match="desc_act .act order. applies to awq with gptq weight rounding"):
        write_awq_checkpoint(str(tiny.path), str(tmp_path / "y"), AWQSettings(group_size=32), windows,
                             desc_act=True)
    assert not (tmp_path / "y").exists() or not any((tmp_path / "y").iterdir())


def test_cli_passes_awq_weight_rounding_and_says_so(tmp_path, capsys, monkeypatch) -> None:
    import loom.quant.quantize as q
    from loom.cli import main

    seen = {}

    def fake(model, output, method, **kw):
        seen.update(kw, method=method)
        qc = {"group_size": 128, "meta": {"scaling": "both", "duo_groups": 3, "scaled_groups": 8, "loss": "mse",
                                          "clip": "off", "clipped": [], "weight_rounding": kw["weight_rounding"]}}
        return q.QuantizeResult(tmp_path / "out", "awq", "random ids", 64, None, 1.0, qc)

    monkeypatch.setattr(q, "quantize", fake)
    assert main(["quantize", "--method", "awq", "--weight-rounding", "gptq", "--output", str(tmp_path / "out")]) == 0
    assert seen["weight_rounding"] == "gptq"
    assert "duo won 3 of 8 groups, weights rounded by GPTQ, unclipped, 64 calibration tokens" in capsys.readouterr().out


@pytest.mark.parametrize(("rounding", "desc_act", "want"), [("gptq", None, True), ("gptq", False, False),
                                                             ("rtn", None, False)])
def test_awq_gptq_rounding_runs_act_order_by_default(tmp_path, monkeypatch, rounding, desc_act, want) -> None:
    """As `--method gptq`, AWQ + GPTQ takes act order unless told not to (measured closer on both models); AWQ's own
    rounding has none."""
    import loom.quant.quantize as q

    seen = {}

    def fake(*args, **_kw):
        seen["desc_act"] = args[-1]
        raise RuntimeError("stop")

    monkeypatch.setattr(q, "_quantize_awq", fake)
    with pytest.raises(RuntimeError, match="stop"):
        q.quantize(None, str(tmp_path / "o"), "awq", weight_rounding=rounding, desc_act=desc_act)
    assert seen["desc_act"] is want
