"""2:4 semi-structured sparsity (loom/quant/sparsity.py): the pattern, Wanda's score against the paper's
definition, and the pruned checkpoint written and run."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.model.loader import load_model
from loom.quant.sparsity import prune_24, wanda_score, write_sparse_checkpoint

CPU = torch.device("cpu")


def test_prune_24_keeps_the_two_largest_of_every_four() -> None:
    w = torch.tensor([[1.0, -4.0, 3.0, 2.0, 0.5, 0.1, -0.2, 0.3]])
    assert torch.equal(prune_24(w, w.abs()), torch.tensor([[0.0, -4.0, 3.0, 0.0, 0.5, 0.0, 0.0, 0.3]]))
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 128, generator=g)
    pruned = prune_24(big, big.abs())
    nonzero = (pruned != 0).reshape(64, 32, 4).sum(-1)
    assert bool((nonzero == 2).all())  # exactly two of every four
    inf = torch.tensor(float("inf"))
    smallest_kept = torch.where(pruned != 0, big.abs(), inf).reshape(64, 32, 4).min(-1).values
    largest_dropped = torch.where(pruned == 0, big.abs(), -inf).reshape(64, 32, 4).max(-1).values
    assert bool((smallest_kept >= largest_dropped).all())
    with pytest.raises(ValueError, match="input_size % 4"):
        prune_24(torch.ones(2, 6), torch.ones(2, 6))


def test_wanda_weighs_magnitude_by_the_input_norm() -> None:
    # a small weight on a loud input outranks a larger weight on a quiet one (the paper's figure 1)
    w = torch.tensor([[0.5, 1.0, 0.2, 0.1]])
    x = torch.tensor([[10.0, 0.1, 1.0, 0.1], [10.0, 0.1, 1.0, 0.1]])  # [tokens, K]
    norm = x.norm(dim=0)
    score = wanda_score(w, norm)
    torch.testing.assert_close(score, w.abs() * norm)
    assert torch.equal(prune_24(w, score), torch.tensor([[0.5, 0.0, 0.2, 0.0]]))
    assert torch.equal(prune_24(w, w.abs()), torch.tensor([[0.5, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("score", ["magnitude", "wanda"])
def test_sparse_checkpoint_is_half_zeros_and_runs(tiny_models, tmp_path, score: str) -> None:
    tiny = tiny_models["qwen2_gqa"]
    rng = random.Random(0)
    windows = [[rng.randrange(tiny.hf.config.vocab_size) for _ in range(32)] for _ in range(2)]
    out = tmp_path / score
    result = write_sparse_checkpoint(str(tiny.path), str(out), score, windows, calibration="random ids")
    assert result.sparsity == pytest.approx(0.5)
    marker = json.loads((out / "config.json").read_text())["loom_quantization"]
    assert marker["prepared_by"] == "sparse24" and marker["score"] == score
    loaded = load_model(str(out), torch.float32, CPU)  # runs as "none"
    w = loaded.model.model.layers[1].mlp.down_proj.weight.data
    assert bool(((w != 0).reshape(w.shape[0], -1, 4).sum(-1) <= 2).all())
    source = tiny.hf.model.layers[1].mlp.down_proj.weight.detach()
    kept = w != 0
    torch.testing.assert_close(w[kept], source[kept])  # kept weights unchanged (no update, as in Wanda)
    norm = loaded.model.model.layers[0].input_layernorm.weight.data
    torch.testing.assert_close(norm, tiny.hf.model.layers[0].input_layernorm.weight.detach())
    from loom.bench.quality import window_logits

    logits = window_logits(loaded.model, loaded.arch, windows[0])
    assert bool(torch.isfinite(logits).all())


def test_wanda_differs_from_magnitude_where_inputs_are_uneven(tiny_models, tmp_path) -> None:
    tiny = tiny_models["llama_gqa"]
    rng = random.Random(1)
    windows = [[rng.randrange(tiny.hf.config.vocab_size) for _ in range(48)] for _ in range(2)]
    a = write_sparse_checkpoint(str(tiny.path), str(tmp_path / "m"), "magnitude", [])
    b = write_sparse_checkpoint(str(tiny.path), str(tmp_path / "w"), "wanda", windows)
    wa = load_model(str(a.output), torch.float32, CPU).model.model.layers[0].self_attn.qkv_proj.weight
    wb = load_model(str(b.output), torch.float32, CPU).model.model.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(wa != 0, wb != 0)
    with pytest.raises(ValueError, match="wanda needs calibration"):
        write_sparse_checkpoint(str(tiny.path), str(tmp_path / "x"), "wanda", [])
