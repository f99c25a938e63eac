"""Block Hadamard rotation (loom/quant/hadamard.py) and w8a8's use of it."""

from __future__ import annotations

import pytest
import torch

from loom.quant.hadamard import hadamard_matrix, rotate, rotate_input, rotate_weight, rotation_block


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_hadamard_matrix_is_symmetric_orthonormal_and_plus_minus(n: int) -> None:
    h = hadamard_matrix(n).double()
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_hadamard_matrix_refuses_a_size_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(12)


@pytest.mark.parametrize(("k", "block"), [(32, 32), (96, 32), (576, 64), (1536, 512), (4096, 512), (2048, 512)])
def test_rotation_block_is_the_largest_power_of_two_dividing_k_capped(k: int, block: int) -> None:
    assert rotation_block(k) == block


@pytest.mark.parametrize(("k", "block"), [(64, 64), (576, 64), (1536, 512), (256, 128)])
def test_rotate_equals_the_block_diagonal_hadamard_product(k: int, block: int) -> None:
    """The Kronecker-factored rotation equals x @ blockdiag(H_block) in float64."""
    torch.manual_seed(0)
    x = torch.randn(5, k, dtype=torch.float64)
    full = torch.block_diag(*[hadamard_matrix(block).double()] * (k // block))
    assert torch.allclose(rotate(x, block), x @ full, atol=1e-10)


def test_rotated_product_equals_the_original_before_rounding() -> None:
    torch.manual_seed(1)
    w, x = torch.randn(40, 1536, dtype=torch.float64), torch.randn(7, 1536, dtype=torch.float64)
    block = rotation_block(1536)
    got = rotate(x, block) @ rotate(w, block).T
    assert torch.allclose(got, x @ w.T, atol=1e-9)
    assert rotate_weight(w, block).dtype == torch.float32


def test_rotation_spreads_an_outlier_channel() -> None:
    """What the rotation is for: one huge channel no longer sets the row's int8 scale for the others."""
    x = torch.full((1, 512), 0.01)
    x[0, 3] = 100.0
    y = rotate(x, 512)
    assert float(y.abs().max()) < 5.0 and torch.allclose(y.norm(), x.norm(), rtol=1e-5)


@pytest.mark.parametrize(("k", "block"), [(96, 32), (128, 128), (576, 64), (1536, 512)])
def test_rotate_input_gives_each_row_the_same_bits_in_any_batch(k: int, block: int) -> None:
    """A row's rotated input, hence its int8 codes and its token, cannot depend on the rows beside it: with
    blocks of 32 a BLAS matmul summed in another order at 64 rows than at one on an AVX2 CPU (Zen 3)."""
    torch.manual_seed(0)
    x = torch.randn(64, k) * torch.logspace(-3, 2, k)  # channels of very different sizes, as activations have
    x[5] = 0.0  # an all-zero row
    whole = rotate_input(x, block)
    assert torch.equal(whole, torch.cat([rotate_input(x[i : i + 1], block) for i in range(64)]))
    assert torch.equal(whole[:7], rotate_input(x[:7], block))
    assert torch.equal(whole[5], torch.zeros(k))
    # the grid of 2^15 steps per block: within max|x| * 2^-16 * sqrt(block) of the float64 rotation per block
    exact = x.double().reshape(64, k // block, block) @ hadamard_matrix(block).double()
    bound = x.abs().reshape(64, k // block, block).amax(-1, keepdim=True).double() * 2.0**-16 * block**0.5
    assert ((whole.double().reshape(64, k // block, block) - exact).abs() <= bound * 1.01 + 1e-30).all()


def test_rotate_refuses_a_size_the_block_does_not_divide() -> None:
    with pytest.raises(ValueError, match="multiple of the rotation block"):
        rotate(torch.zeros(2, 96), 64)


def test_w8a8_layer_is_near_its_float64_product_and_rotated(tiny_models) -> None:
    """A w8a8 layer: weights and inputs rotated, then int8 (groups of 32 / per token) - within int8's error of
    the float64 product, and closer than the same layer without the rotation on an input with an outlier."""
    from loom.model.loader import load_model

    path = str(tiny_models["llama_gqa"].path)
    dense = load_model(path, torch.float32, torch.device("cpu"), quantization="none")
    quant = load_model(path, torch.float32, torch.device("cpu"), quantization="w8a8")
    layer = quant.model.model.layers[0].mlp.down_proj
    w = dense.model.model.layers[0].mlp.down_proj.weight.double()
    assert layer.rotation_block == rotation_block(layer.input_size) and layer.rotation_block >= 32
    assert "Hadamard" in layer.quant_method.weight_format(layer)[0]
    torch.manual_seed(2)
    x = torch.randn(6, layer.input_size)
    x[:, 5] *= 80.0  # an outlier channel, as LLM activations have
    ref = x.double() @ w.T
    rel = float((layer(x).double() - ref).norm() / ref.norm())
    block = layer.rotation_block
    layer.rotation_block = 0  # the same int8 weights without the input rotation: a wrong product
    unrotated = float((layer(x).double() - ref).norm() / ref.norm())
    assert unrotated > 0.5, unrotated  # the check below would catch a missing input rotation
    layer.rotation_block = block
    # the plain scheme (no rotation): int8 groups of 32 of W, one int8 scale per token of x
    from loom.quant.layout import dequantize
    from loom.quant.rtn import quantize_q8

    wq = dequantize(quantize_q8(w.float(), 32)).double()
    s = x.abs().amax(dim=1, keepdim=True) / 127
    plain = float((((x / s).round() * s).double() @ wq.T - ref).norm() / ref.norm())
    assert rel < 0.02 and rel < plain / 2, (rel, plain)
