"""SmoothQuant (loom/quant/smoothquant.py) and `loom quantize` (loom/quant/quantize.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from loom.bench.quality import window_logits
from loom.model.loader import load_model
from loom.quant.smoothquant import collect_input_absmax, search_alpha, smooth_weights, smoothing_factors

CPU = torch.device("cpu")


def test_smoothing_factors_follow_the_paper() -> None:
    act, wt = torch.tensor([4.0, 9.0, 1.0]), torch.tensor([1.0, 4.0, 0.25])
    s = smoothing_factors(act, wt, 0.5)
    assert torch.allclose(s, act.sqrt() / wt.sqrt())
    # after smoothing, max|X_j / s_j| == max|W_j * s_j| at alpha 0.5: the difficulty is shared evenly
    assert torch.allclose(act / s, wt * s)
    assert torch.allclose(smoothing_factors(act, wt, 1.0), act)


def test_smoothing_factors_leave_unseen_channels_alone_and_check_alpha() -> None:
    s = smoothing_factors(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]), 0.5)
    assert torch.equal(s, torch.ones(2))
    with pytest.raises(ValueError, match="alpha must be in"):
        smoothing_factors(torch.ones(2), torch.ones(2), 1.5)
    with pytest.raises(ValueError, match="statistics"):
        smoothing_factors(torch.ones(2), torch.ones(3), 0.5)


def _windows(vocab: int, n: int = 3, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _hf_weights(path) -> dict[str, torch.Tensor]:
    from loom.model.loader.safetensors import iter_safetensors_weights

    return dict(iter_safetensors_weights(path))


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha_tied", "qwen2_gqa"])
@pytest.mark.parametrize("alpha", [0.5, "per-layer"])
def test_smoothing_preserves_the_model_before_rounding(tiny_models, name: str, alpha) -> None:
    """SmoothQuant moves scale between activations and weights: the float model computes the same logits
    (GQA's shared o_proj scales, Qwen2's v bias, tied embeddings included)."""
    tiny = tiny_models[name]
    loaded = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    arch = loaded.arch
    stats = collect_input_absmax(loaded.model, arch, _windows(arch.vocab_size))
    assert {k.rsplit(".", 1)[-1] for k in stats} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    if alpha == "per-layer":
        alpha = {k: 0.2 + 0.6 * (i % 4) / 3 for i, k in enumerate(sorted(stats))}
    weights = _hf_weights(tiny.path)
    smoothed = smooth_weights(weights, stats, arch, alpha)
    changed = [k for k in weights if not torch.equal(weights[k].float(), smoothed[k].float())]
    assert any("input_layernorm" in k for k in changed) and any("o_proj" in k for k in changed)
    from loom.model.registry import get_model_class
    from loom.attention.backend import get_attention_backend
    from loom.quant.config import NoQuantConfig

    net = get_model_class(arch.architecture)(arch, get_attention_backend("cpu_paged", float32_kernels=False),
                                             torch.float32, CPU, NoQuantConfig())
    net.load_weights(smoothed.items())
    tokens = _windows(arch.vocab_size, 1, 30, seed=9)[0]
    ref, got = window_logits(loaded.model, arch, tokens), window_logits(net.eval(), arch, tokens)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()


def test_smoothing_flattens_the_activation_outliers(tiny_models) -> None:
    """What it is for: after smoothing, each layer's input channels are closer in range (max/median of the
    per-channel max |x| falls), measured on the smoothed model itself."""
    from loom.model.registry import get_model_class
    from loom.attention.backend import get_attention_backend
    from loom.quant.config import NoQuantConfig

    tiny = tiny_models["llama_gqa"]
    loaded = load_model(str(tiny.path), torch.float32, CPU, quantization="none")
    arch, windows = loaded.arch, _windows(loaded.arch.vocab_size)
    with torch.no_grad():  # give the first norm an outlier channel, as trained LLMs have
        loaded.model.model.layers[0].input_layernorm.weight[7] *= 50.0
    stats = collect_input_absmax(loaded.model, arch, windows)
    weights = _hf_weights(tiny.path)
    weights["model.layers.0.input_layernorm.weight"] = loaded.model.model.layers[0].input_layernorm.weight.clone()
    net = get_model_class(arch.architecture)(arch, get_attention_backend("cpu_paged", float32_kernels=False),
                                             torch.float32, CPU, NoQuantConfig())
    net.load_weights(smooth_weights(weights, stats, arch, 0.5).items())
    after = collect_input_absmax(net.eval(), arch, windows)

    def spread(t: torch.Tensor) -> float:
        return float(t.max() / t.median())

    name = "model.layers.0.self_attn.qkv_proj"
    assert spread(stats[name]) > 20 and spread(after[name]) < spread(stats[name]) / 4


def test_search_alpha_picks_from_the_grid_for_every_layer(tiny_models) -> None:
    loaded = load_model(str(tiny_models["llama_gqa"].path), torch.float32, CPU, quantization="none")
    windows = _windows(loaded.arch.vocab_size)
    stats = collect_input_absmax(loaded.model, loaded.arch, windows)
    grid = (0.25, 0.5, 0.75)
    alphas = search_alpha(loaded.model, loaded.arch, windows, stats, grid=grid)
    assert set(alphas) == set(stats) and set(alphas.values()) <= set(grid)


def test_smoothquant_checkpoint_loads_as_w8a8_and_as_the_same_float_model(tiny_models, tmp_path) -> None:
    from loom.quant.methods import PackedLinearMethod
    from loom.quant.quantize import CONFIG_KEY, smoothquant_checkpoint

    tiny = tiny_models["qwen2_gqa"]
    arch = load_model(str(tiny.path), torch.float32, CPU, quantization="none").arch
    out = tmp_path / "sq"
    result = smoothquant_checkpoint(str(tiny.path), str(out), _windows(arch.vocab_size), alpha=0.5,
                                    calibration="random ids")
    config = json.loads((out / "config.json").read_text())
    assert config[CONFIG_KEY]["method"] == "w8a8" and config[CONFIG_KEY]["alpha"] == 0.5
    assert result.calibration_tokens == 120
    default = load_model(str(out), torch.float32, CPU)  # no quantization asked: the prepared method
    down = default.model.model.layers[0].mlp.down_proj
    assert isinstance(down.quant_method, PackedLinearMethod) and down.quant_method.scheme.name == "w8a8"
    # as a plain checkpoint, transformers reads it and computes the source model's logits
    from transformers import AutoModelForCausalLM

    from tests.model.model_harness import hf_logits

    tokens = _windows(arch.vocab_size, 1, 20, seed=5)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.allclose(hf_logits(hf, tokens), hf_logits(tiny.hf, tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="is a directory that is not empty"):
        smoothquant_checkpoint(str(tiny.path), str(out), _windows(arch.vocab_size))
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    mode = stat.S_IMODE((out / "model.safetensors").stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((out / "config.json").stat().st_mode)  # not safetensors' 0600


def test_quantize_refuses_bad_arguments(tmp_path) -> None:
    from loom.quant.quantize import calibration_windows, quantize

    with pytest.raises(ValueError, match="alpha must be in"):
        quantize(None, str(tmp_path / "a"), alpha=2.0)
    with pytest.raises(ValueError, match="method must be one of"):
        quantize(None, str(tmp_path / "a"), method="no-such-method")
    # checked before any calibration work (found by a fresh-user trial: these failed after a minute)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        quantize(None, str(afile))
    with pytest.raises(ValueError, match="cannot be created"):
        quantize(None, "/proc/no-such-dir/out")
    with pytest.raises(ValueError, match="calibration_window_len must be <= the model's context of 8192"):
        quantize(None, str(tmp_path / "b"), window_len=100_000)
    assert not (tmp_path / "b").exists()

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(range(len(text.split())))

    text = tmp_path / "cal.txt"
    text.write_text("one two three")
    with pytest.raises(ValueError, match="calibration_file .* fewer than calibration_windows x "
                                         "calibration_window_len = 2 x 4"):
        calibration_windows(Tok(), str(text), 2, 4)
    with pytest.raises(ValueError, match="output must be a directory path, got an empty one"):
        quantize(None, "  ")
    with pytest.raises(ValueError, match="calibration_file"):
        calibration_windows(Tok(), str(tmp_path / "missing.txt"), 1, 2)
    windows, source = calibration_windows(Tok(), str(text), 1, 2)
    assert windows == [[0, 1]] and source == str(text)


def test_a_failed_quantize_removes_the_output_it_created(tmp_path) -> None:
    """A failure after the output directory was made (here: the calibration file is missing) leaves nothing that
    would refuse the next run as 'not empty'; a directory the user made beforehand stays."""
    from loom.quant.quantize import quantize

    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="calibration_file"):
        quantize(None, str(tmp_path / "new" / "out"), calibration_file=missing)
    assert not (tmp_path / "new").exists()  # nor the parent the call made for it
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="calibration_file"):
        quantize(None, str(tmp_path / "mine"), calibration_file=missing)
    assert (tmp_path / "mine").is_dir()


def test_an_interrupted_write_into_an_empty_directory_leaves_it_empty(tmp_path) -> None:
    """Ctrl-C while the checkpoint was being written into a directory the user had made (empty) left a complete
    model.safetensors there, so the retry was refused as 'not empty' (fresh-user trial). What the call wrote goes;
    the directory stays; a directory that was not empty is never touched."""
    from loom.quant.quantize import _removes_new_output_on_failure

    @_removes_new_output_on_failure
    def write(_model, output, exc):  # noqa: ANN001, ANN202
        out = Path(output)
        (out / "model.safetensors").write_bytes(b"x" * 10)
        (out / "sub").mkdir()
        (out / "sub" / "part").write_text("y")
        (out / ".tmp123").write_text("z")
        raise exc

    mine = tmp_path / "mine"
    mine.mkdir()
    for exc in (KeyboardInterrupt(), SystemExit(143), ValueError("late failure")):
        with pytest.raises(type(exc)):
            write(None, str(mine), exc)
        assert mine.is_dir() and not any(mine.iterdir())
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("the user's")

    @_removes_new_output_on_failure
    def refuse(_model, output):  # noqa: ANN001, ANN202
        raise ValueError("not empty")

    with pytest.raises(ValueError):
        refuse(None, str(full))
    assert (full / "keep.txt").read_text() == "the user's"


def test_sigterm_unwinds_a_quantize_run_and_removes_its_output(tmp_path, monkeypatch) -> None:
    """`kill` (SIGTERM) of `loom quantize` left its output directory (or a hidden temporary file) behind; it now
    exits with status 143 through the same clean-up as Ctrl-C, and the handler is restored afterwards."""
    import os
    import signal

    import loom.quant.quantize as q
    from loom.cli import main

    def fake(model, output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        Path(output).mkdir(parents=True)
        (Path(output) / "model.safetensors").write_bytes(b"x")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(q, "quantize", q._removes_new_output_on_failure(fake))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--output", str(tmp_path / "new" / "out")])
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert not (tmp_path / "new").exists()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_loom_quantize_cli_on_the_bundled_model(tmp_path, capsys, llm) -> None:
    """`loom quantize` end to end on the real model with a text file: the output generates the same greedy text
    as the source in float32 (--quantization none) and runs as w8a8 by default."""
    from loom import LLM, SamplingParams
    from loom.cli import main

    text = tmp_path / "cal.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    out = tmp_path / "sq"
    assert main(["quantize", "--output", str(out), "--calibration-file", str(text), "--calibration-windows", "2",
                 "--calibration-window-len", "64", "--alpha", "0.5"]) == 0
    assert "runs as w8a8" in capsys.readouterr().out
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = "The capital of France is"
    src = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]  # the session's float32 "none" engine
    same = LLM(model=str(out), dtype="float32", quantization="none").generate([prompt], params, use_tqdm=False)
    assert same[0].outputs[0].token_ids == src.token_ids
    w8a8 = LLM(model=str(out))
    formats = {fmt for kind, (fmt, _) in w8a8.engine.runner.model.weight_report().items() if kind.endswith("proj")}
    assert formats and all(f.startswith("w8a8 q8g/channel") and "Hadamard" in f for f in formats), formats
    assert w8a8.engine.runner.dtype == torch.float32  # auto dtype of a packed method on CPU
    assert len(w8a8.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("args", [["--alpha", "2"], ["--alpha", "x"], ["--calibration-windows", "0"], ["--group-size", "48"],
                                  ["--bits", "3"], ["--damp-percent", "1.5"], ["--calibration-window-len", "1"]])
def test_loom_quantize_cli_refuses_bad_options(tmp_path, capsys, args: list[str]) -> None:
    from loom.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--output", str(tmp_path / "o"), *args])
    assert exc.value.code == 2 and args[0] in capsys.readouterr().err


@pytest.mark.parametrize(("method", "option", "value"), [
    ("rtn", "static_groups", True), ("rtn", "desc_act", True), ("rtn", "damp_percent", 0.1), ("awq", "static_groups", True),
    ("awq", "sym", True), ("fp8", "bits", 4), ("gptq", "alpha", 0.3), ("smoothquant", "awq_clip", "off"),
    ("gptq", "awq_scaling", "duo"), ("rtn", "awq_loss", "normalized"),
    ("sparse24", "group_size", 32), ("gptq", "prune_score", "magnitude"),
    ("smoothquant", "activation_scales", "static"),
    ("w8a8", "target_bits", 4.5), ("rtn", "weight_rounding", "gptq")])
def test_quantize_refuses_an_option_its_method_does_not_read(tmp_path, method: str, option: str, value) -> None:
    """Every method-specific option given to another method is an error before any work (a fresh-user trial found
    `--method awq --desc-act`, `--method fp8 --bits 4`, `--method rtn --static-groups` silently ignored)."""
    from loom.quant import METHOD_OPTIONS
    from loom.quant.quantize import quantize

    assert method not in METHOD_OPTIONS[option]
    with pytest.raises(ValueError, match=f"^{option} applies to methods? .*, not '{method}'$"):
        quantize(None, str(tmp_path / "o"), method, **{option: value})
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--method", "awq", "--desc-act"], "--desc-act applies to awq with --weight-rounding 'gptq'"),
    (["--method", "smoothquant", "--awq-clip", "on"], "--awq-clip applies to method 'awq', not 'smoothquant'"),
    (["--method", "gptq", "--no-desc-act", "--static-groups"], "--static-groups applies with --desc-act"),
    (["--method", "fp8", "--bits", "4"], "--bits applies to methods 'rtn', 'gptq' and 'awq', not 'fp8'"),
    (["--method", "gptq", "--weight-rounding", "gptq"],
     "--weight-rounding applies to methods 'smoothquant', 'w8a8' and 'awq', not 'gptq'"),
    (["--output", ""], "--output must be a directory path, got an empty one"),
    (["--method", "rtn", "--calibration-windows", "4"],
     "--calibration-windows applies to a run that calibrates (smoothquant, w8a8, gptq, awq, sparse24 with "
     "--prune-score 'wanda', rtn with --target-bits), not method 'rtn' without --target-bits"),
    (["--method", "fp8", "--calibration-file", "x.txt"], "--calibration-file applies to a run that calibrates"),
    (["--method", "sparse24", "--prune-score", "magnitude", "--calibration-window-len", "64"],
     "not method 'sparse24' with --prune-score 'magnitude'"),
    (["--method", "rtn", "--sensitivity-windows", "2"], "--sensitivity-windows applies with --target-bits"),
    (["--method", "rtn", "--target-bits", "4.5", "--sensitivity-windows", "5", "--calibration-windows", "2"],
     "--sensitivity-windows (5) must be <= --calibration-windows (2)")])
def test_loom_quantize_cli_names_the_flag_a_method_does_not_read(tmp_path, capsys, args: list[str],
                                                                  message: str) -> None:
    from loom.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--output", str(tmp_path / "o"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("method", "options"), [
    ("rtn", {}), ("fp8", {}), ("sparse24", {"prune_score": "magnitude"})])
def test_calibration_options_are_refused_where_nothing_calibrates(tmp_path, method: str, options: dict) -> None:
    """A run that reads no calibration tokens refuses calibration options instead of ignoring them (they defaulted
    to numbers, so `--method rtn --calibration-windows 32` once ran as if the flag were not there)."""
    from loom.quant.quantize import calibrates, quantize

    assert not calibrates(method, options.get("target_bits"), options.get("prune_score", "wanda"))
    for option, value in (("calibration_file", "x.txt"), ("num_windows", 4), ("window_len", 64)):
        with pytest.raises(ValueError, match=r"^calibration_\w+ applies to a run that calibrates"):
            quantize(None, str(tmp_path / "o"), method, **options, **{option: value})
    assert not (tmp_path / "o").exists()
    assert calibrates("rtn", 4.5, "wanda") and calibrates("sparse24", None, "wanda") and calibrates("awq", None, "")


def test_default_calibration_alternates_chat_and_prose(monkeypatch) -> None:
    """The default calibration (no file) alternates ShareGPT chat windows and windows of Emma (calibrated on one
    source alone, GPTQ overfit it: NOTES "GPTQ's default calibration"), chat first, so any prefix of the windows
    (mixed precision's sensitivity reads the first) holds chat; without the novel, every window is chat and the
    label says so."""
    import loom.bench.heldout as heldout
    from loom.model.loader import load_tokenizer
    from loom.quant import quantize as q

    tokenizer = load_tokenizer(None)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    emma = tokenizer.encode(heldout.janeausten_text("emma"), add_special_tokens=False)
    windows, source = q.calibration_windows(tokenizer, None, 5, 64)
    assert [len(w) for w in windows] == [64] * 5
    assert "ShareGPT" in source and "Emma" in source
    chat = q._chat_windows(tokenizer, 3, 64)
    assert windows[0][0] == im_start and windows[0::2] == chat  # chat, prose, chat, prose, chat
    assert windows[1] == emma[:64] and windows[3] == emma[64:128]
    one, source = q.calibration_windows(tokenizer, None, 1, 64)
    assert one == chat[:1] and "only" in source and "emma" not in source  # one window: chat, and labelled so

    def unavailable(book: str) -> str:
        raise RuntimeError("apt-get not found")

    monkeypatch.setattr(heldout, "janeausten_text", unavailable)
    windows, source = q.calibration_windows(tokenizer, None, 4, 64)
    assert windows == q._chat_windows(tokenizer, 4, 64)
    assert "only" in source and "unavailable" in source


def test_evaluation_refuses_the_calibration_novel(tmp_path) -> None:
    """`loom bench quality|quant --book B` refuses a checkpoint calibrated on B (evaluation text must be disjoint
    from calibration text, and the default calibration reads Emma); other books, GGUF files and checkpoints
    without a calibration label pass."""
    import json

    from loom.bench.heldout import check_not_calibrated_on
    from loom.quant.quantize import CALIBRATION_BOOK, SHAREGPT_SOURCE

    gptq = tmp_path / "gptq"
    gptq.mkdir()
    label = f"{SHAREGPT_SOURCE} and Jane Austen's {CALIBRATION_BOOK.title()}, alternating windows"
    (gptq / "config.json").write_text(json.dumps({"quantization_config": {"meta": {"calibration": label}}}))
    w8a8 = tmp_path / "w8a8"
    w8a8.mkdir()
    (w8a8 / "config.json").write_text(json.dumps({"loom_prepared": [{"calibration": label}]}))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for model in (gptq, w8a8):
        with pytest.raises(ValueError, match="--book emma: .* was calibrated on that novel"):
            check_not_calibrated_on([str(plain), None, str(model)], "emma")
        check_not_calibrated_on([str(model)], "prideprejudice")
    check_not_calibrated_on([str(plain), None, str(tmp_path / "model.gguf")], "emma")
