"""Block Hadamard rotation of a linear layer's input, for int8 activations (incoherence processing).

A few input channels of an LLM's activations are far larger than the rest, so one int8 scale per token leaves
the others a handful of levels. An orthonormal rotation H spreads every channel's energy over its block, and
W x = (W H^T)(H x) leaves the product unchanged before rounding: the weight is rotated once at load and each
input is rotated before it is quantized. This is the online rotation of QuaRot (Ashkboos et al. 2024,
arXiv:2404.00456), after QuIP's incoherence processing (Chee et al. 2023, arXiv:2307.13304); the Hadamard
matrix is Sylvester's, so H = H^T and H H = I.

The rotation is block-diagonal: blocks of `block` channels, the largest power of two dividing the input size,
at most MAX_BLOCK. A block of 2^a * 2^b runs as two small matmuls (H_{2^a} (x) H_{2^b} = Kronecker factors),
about (2^a + 2^b) multiply-adds per channel instead of 2^(a+b).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MAX_BLOCK = 512  # channels per rotation block (measured on SmolLM2: 64 and 512 within noise of each other)
_FACTOR = 64  # the Kronecker factors' largest size


@functools.cache
def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's normalized Hadamard matrix, float32 [n, n], symmetric and orthonormal.

    Raises:
        ValueError: n is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / n**0.5).float()


def rotation_block(input_size: int) -> int:
    """Channels per block for a layer of `input_size` inputs: the largest power of two dividing it, capped."""
    block = 1
    while input_size % (block * 2) == 0 and block * 2 <= MAX_BLOCK:
        block *= 2
    return block


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] -> x with each block of `block` consecutive channels multiplied by H_block (same dtype).

    Raises:
        ValueError: K is not a multiple of `block`, or block not a power of two.
    """
    return _kronecker_rotate(x, block, hadamard_matrix).reshape(x.shape)


def _kronecker_rotate(x: torch.Tensor, block: int, matrix: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """x [..., K] -> [rows, K // block, outer, inner]: each block times matrix(outer) (x) matrix(inner), the
    inner factor first, in x's dtype (matrix(n): an [n, n] Hadamard matrix, normalized or +-1)."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of the rotation block {block}")
    inner = min(block, _FACTOR)
    outer = block // inner
    y = x.reshape(-1, k // block, outer, inner) @ matrix(inner).to(device=x.device, dtype=x.dtype)
    if outer > 1:
        y = matrix(outer).to(device=x.device, dtype=x.dtype) @ y
    return y


_GRID_BITS = 15  # rotate_input: |codes| <= 2^15, so a block's sums of up to 512 codes stay below 2^24


def rotate_input(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] float -> the rotation of `rotate`, computed so that each row's result is the same bits whatever
    the other rows (float32 result, then x's dtype).

    A BLAS matmul may sum a row's products in another order when the number of rows changes (seen with blocks of
    32 on an AVX2 CPU), and a token's int8 codes, hence its greedy output, would then depend on its batch. Here
    each block of x is first put on a grid of 2^15 steps of its max|x| (q = round(x / s), s = max|x| / 2^15:
    an error of at most max|x| / 2^16 per channel, 256 times below the per-token int8 step that follows), so the
    rotation multiplies integers |q| <= 2^15 by the unnormalized +-1 Hadamard matrix: every partial sum is an
    integer below 2^24, exact in float32 in any order; the result is then scaled by s / sqrt(block).

    Raises:
        ValueError: K is not a multiple of `block`, or block not a power of two.
    """
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of the rotation block {block}")
    if block > 1 << (24 - _GRID_BITS):
        raise ValueError(f"rotation block {block} > {1 << (24 - _GRID_BITS)}: its sums would not be exact")
    blocks = x.float().reshape(-1, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = torch.where(amax > 0, amax, 1.0) / (1 << _GRID_BITS)
    y = _kronecker_rotate(torch.round(blocks / step), block, _unnormalized)
    return (y.reshape(blocks.shape) * (step / block**0.5)).reshape(x.shape).to(x.dtype)


@functools.cache
def _unnormalized(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix with +-1 entries, float32 [n, n]."""
    return torch.sign(hadamard_matrix(n))


def rotate_weight(weight: torch.Tensor, block: int) -> torch.Tensor:
    """weight [N, K] -> W H^T in float32, so that rotate(x) @ (W H^T)^T == x @ W^T (H is symmetric, so the
    rows rotate exactly as inputs do)."""
    return rotate(weight.float(), block)
