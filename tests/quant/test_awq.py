"""AWQ on matrices (loom/quant/awq.py) and the AutoAWQ gemm tensor format (loom/quant/awq_format.py)."""

from __future__ import annotations

import pytest
import torch

from loom.quant.awq import (
    activation_scales,
    apply_clip,
    awq_quantize,
    fake_quantize,
    normalized_loss,
    search_clip,
    search_scales,
    weight_mean,
)
from loom.quant.awq_format import (
    ORDER,
    check_quantization_config,
    from_checkpoint,
    pack_awq,
    quantization_config,
    to_checkpoint,
    unpack_awq,
)
from loom.quant.gptq_format import to_loom
from loom.quant.layout import dequantize


def outlier_inputs(k: int, rows: int, seed: int, channels: int = 4, factor: float = 30.0) -> torch.Tensor:
    """X [rows, k] Gaussian with a few input channels `factor` times larger (AWQ's salient channels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:channels]] *= factor
    return x


@pytest.mark.parametrize(("k", "group_size", "seed"), [(256, 128, 0), (128, 32, 1), (320, 128, 2)])
def test_search_lowers_the_quantized_output_error_versus_rtn(k: int, group_size: int, seed: int) -> None:
    x = outlier_inputs(k, 512, seed)
    w = torch.randn(96, k, generator=torch.Generator().manual_seed(seed + 10)) * 0.05

    def block(ws: list[torch.Tensor]) -> torch.Tensor:
        return x @ ws[0].T

    s, alpha, duo, errors = search_scales(x.abs().mean(0), [w], block, group_size)
    assert not duo and len(errors) == 20
    rtn = float((x @ fake_quantize(w, group_size).T - x @ w.T).square().mean())
    assert errors[0] == pytest.approx(rtn, rel=1e-6)  # alpha 0 is RTN (s = 1)
    assert torch.allclose(activation_scales(x.abs().mean(0), 0.0), torch.ones(k))
    awq = float((x @ (fake_quantize(w * s, group_size) / s).T - x @ w.T).square().mean())
    assert alpha > 0 and awq == min(errors) and awq < 0.8 * rtn
    # held-out tokens of the same distribution gain too
    x2 = outlier_inputs(k, 512, seed)[:, :]  # same salient channels, new rows below
    x2 = x2 * torch.randn(512, 1, generator=torch.Generator().manual_seed(99)).abs()
    held_rtn = (x2 @ fake_quantize(w, group_size).T - x2 @ w.T).square().mean()
    held_awq = (x2 @ (fake_quantize(w * s, group_size) / s).T - x2 @ w.T).square().mean()
    assert held_awq < held_rtn


def test_weight_mean_is_the_group_normalised_magnitude() -> None:
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(7))
    w2 = torch.randn(4, 96, generator=torch.Generator().manual_seed(8))
    got = weight_mean([w, w2], 64)  # groups of 64 and a last one of 32
    both = torch.cat([w, w2]).abs()
    want = torch.cat([both[:, :64] / both[:, :64].amax(1, keepdim=True),
                      both[:, 64:] / both[:, 64:].amax(1, keepdim=True)], dim=1).mean(0)
    assert got.shape == (96,) and torch.allclose(got, want, atol=1e-5)
    # the duo formula divides by it: at alpha 0 the small-weight channels get the large scales
    s = activation_scales(torch.ones(96), 0.0, got)
    assert int(s.argmax()) == int(got.argmin())


@pytest.mark.parametrize("seed", [0, 1])
def test_both_searches_each_grid_and_keeps_the_better(seed: int) -> None:
    x = outlier_inputs(256, 384, seed)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed + 20)) * 0.05
    w[:, :8] *= 6  # weight-magnitude structure the duo formula sees

    def block(ws: list[torch.Tensor]) -> torch.Tensor:
        return x @ ws[0].T

    act = search_scales(x.abs().mean(0), [w], block, 128, scaling="activation")
    duo = search_scales(x.abs().mean(0), [w], block, 128, scaling="duo")
    both = search_scales(x.abs().mean(0), [w], block, 128, scaling="both")
    assert duo.duo and not act.duo and len(both.errors) == 40
    assert both.errors == pytest.approx(act.errors + duo.errors, rel=1e-6)
    assert min(both.errors) == pytest.approx(min(min(act.errors), min(duo.errors)), rel=1e-6)
    chosen = float((x @ (fake_quantize(w * both.scales, 128) / both.scales).T - x @ w.T).square().mean())
    assert chosen == pytest.approx(min(both.errors), rel=1e-5)
    assert both.duo == (min(duo.errors) < min(act.errors))
    with pytest.raises(ValueError, match="scaling must be one of"):
        search_scales(x.abs().mean(0), [w], block, 128, scaling="weights")


def test_normalized_loss_ignores_an_output_channel_s_magnitude() -> None:
    """With the per-channel normalised error, making one output row 1024x larger (a power of two: its 4-bit grid
    scales exactly) leaves every candidate's error, so the choice, as it was; the plain error is then decided by
    that row alone (Qwen's massive residual channels, in miniature)."""
    x = outlier_inputs(256, 384, 5)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7)) * 0.05
    big = w.clone()
    big[3] *= 1024

    def search(weights: torch.Tensor, normalized: bool):
        def block(ws: list[torch.Tensor]) -> torch.Tensor:
            return x @ ws[0].T
        return search_scales(x.abs().mean(0), [weights], normalized_loss(block) if normalized else block, 128,
                             scaling="both")

    same, scaled = search(w, True), search(big, True)
    assert scaled.errors == pytest.approx(same.errors, rel=1e-4) and scaled.alpha == same.alpha
    plain = search(big, False)
    row3 = [float(((x @ (fake_quantize(big[3:4] * s, 128) / s).T) - x @ big[3:4].T).square().sum()) / big.shape[0]
            / x.shape[0] for s in (activation_scales(x.abs().mean(0), a) for a in (0.0, 0.5))]
    assert plain.errors[0] == pytest.approx(row3[0], rel=0.01) and plain.errors[10] == pytest.approx(row3[1], rel=0.01)


def test_scales_favour_the_large_channels() -> None:
    x = outlier_inputs(128, 256, 3, channels=2)
    s = activation_scales(x.abs().mean(0), 0.5)
    big = x.abs().mean(0) > 5 * x.abs().mean(0).median()
    assert bool((s[big].min() > s[~big].max()))
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)  # normalised around 1


def test_clipping_never_raises_the_group_error() -> None:
    x = outlier_inputs(256, 300, 4)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    w[:, 7] *= 8  # a weight outlier worth clipping
    bounds = search_clip(w, x, 128)
    assert bounds.shape == (64, 2) and bool((bounds <= w.abs().reshape(64, 2, 128).amax(-1) + 1e-6).all())
    before = (x @ fake_quantize(w, 128).T - x @ w.T).square().mean()
    after = (x @ fake_quantize(apply_clip(w, bounds, 128), 128).T - x @ w.T).square().mean()
    assert after <= before


def test_grid_and_codes_agree() -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(6))
    w[0, :128] = w[0, :128].abs() + 0.5  # an all-positive group: zero clamps at 0
    q = awq_quantize(w, 128)
    assert q.codes.dtype == torch.int32 and q.scales.dtype == torch.float16 and q.scales.shape == (2, 16)
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15 and int(q.zeros[0, 0]) == 0
    torch.testing.assert_close(q.dequantize(), fake_quantize(w, 128), rtol=0, atol=1e-6)


def test_pack_order_follows_the_spec() -> None:
    # one word: nibble i (bits 4i..4i+3) holds column ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i]
    codes = torch.arange(8, dtype=torch.int32).view(1, 8)  # column c holds code c
    word = int(pack_awq(codes)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(ORDER)
    assert word == 0x75316420
    g = torch.Generator().manual_seed(7)
    many = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.int32)
    packed = pack_awq(many)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert torch.equal(unpack_awq(packed), many)
    with pytest.raises(ValueError, match="pack 8"):
        pack_awq(many[:, :12])


@pytest.mark.parametrize("k", [256, 576])  # 576 = SmolLM2's hidden size: four groups of 128 and one of 64
def test_checkpoint_round_trip_and_loom_layout(k: int) -> None:
    n, gs = 48, 128
    groups = -(-k // gs)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(8))
    q = awq_quantize(w, gs)
    t = to_checkpoint(q)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k, n // 8)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (groups, n // 8)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (groups, n)
    assert torch.equal(unpack_awq(t["qweight"]), q.codes.T) and torch.equal(unpack_awq(t["qzeros"]), q.zeros)
    back = from_checkpoint(t, gs)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
    assert torch.equal(back.scales, q.scales) and torch.equal(back.g_idx, q.g_idx)
    loom = to_loom(back)  # a g128 group = a q4g group of 128 with its scale, min = -zero * scale (float16)
    assert loom.packed is not None and loom.packed.layout == "q4g" and loom.input_perm is None
    b = loom.packed.group_size  # 128 where it divides K, else blocks of the largest power of 2 that does
    assert b == max(d for d in (32, 64, 128) if k % d == 0)
    assert torch.equal(loom.packed.scales, q.scales.repeat_interleave(gs // b, dim=0)[: k // b].T)
    ref = q.dequantize()
    torch.testing.assert_close(dequantize(loom.packed), ref, rtol=0, atol=float(ref.abs().max()) * 2**-10)


def test_quantization_config_keys() -> None:
    qc = quantization_config(128)
    assert {k: qc[k] for k in ("quant_method", "version", "bits", "group_size", "zero_point")} == {
        "quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": True}
    assert check_quantization_config(qc) == 128
    assert check_quantization_config({"quant_method": "awq", "version": "GEMM", "w_bit": 4,
                                      "q_group_size": 64, "zero_point": True}) == 64
    with pytest.raises(ValueError, match="version"):
        check_quantization_config({**qc, "version": "gemv"})
    with pytest.raises(ValueError, match="bits"):
        check_quantization_config({**qc, "bits": 8})


def test_a_group_size_that_does_not_match_the_file_is_refused() -> None:
    """A config whose group_size gives the file's number of groups but other boundaries (139 for a file written at
    128 over K = 576: ceil(576 / 139) = 5 as ceil(576 / 128)) would read the scales of the wrong columns: refused,
    naming the config field. Sizes that divide K, and loom's multiples of 32 with a shorter last group, read."""
    k, n = 576, 16
    q = awq_quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(2)), 128)
    t = to_checkpoint(q)
    assert torch.equal(from_checkpoint(t, 128).codes, q.codes)
    for wrong in (139, 130, 116):
        with pytest.raises(ValueError, match="quantization_config.group_size .* does not match this file"):
            from_checkpoint(t, wrong)
