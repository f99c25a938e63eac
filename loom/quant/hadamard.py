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
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of the rotation block {block}")
    inner = min(block, _FACTOR)
    outer = block // inner
    h_in = hadamard_matrix(inner).to(device=x.device, dtype=x.dtype)
    y = (x.reshape(-1, k // block, outer, inner) @ h_in)  # H_outer (x) H_inner: inner factor first
    if outer > 1:
        y = hadamard_matrix(outer).to(device=x.device, dtype=x.dtype) @ y
    return y.reshape(x.shape)


def rotate_weight(weight: torch.Tensor, block: int) -> torch.Tensor:
    """weight [N, K] -> W H^T in float32, so that rotate(x) @ (W H^T)^T == x @ W^T (H is symmetric, so the
    rows rotate exactly as inputs do)."""
    return rotate(weight.float(), block)
