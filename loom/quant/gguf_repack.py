"""Repack GGUF quantized tensors, at load, into loom's packed layouts (`loom.quant.layout`).

Each supported GGML type maps onto `q4g` or `q8g` with no requantization: the integer codes are carried
over unchanged (only re-laid out), the scales / mins are GGUF's own float16 values, or for the K-quants the
float16 rounding of GGUF's two-level (super-block float16 x 6/8-bit sub-block) scale.

Block formats (ggml's quant formats, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md and
ggml-common.h; the authority used here is the `gguf` Python library's numpy `dequantize`, gguf/quants.py).
All multi-byte fields little-endian; "nibbles" means byte i of a 16-byte run holds element i in its low
nibble and element i + 16 in its high nibble.

- Q4_0 (32 values, 18 B): d f16, qs[16] nibbles; w = d * (q - 8).
  -> q4g, codes q, scale d, min fp16(-8d) (exact; ValueError if |8d| > 65504).                  EXACT
- Q4_1 (32 values, 20 B): d f16, m f16, qs[16] nibbles; w = d * q + m.  -> q4g, a copy.           EXACT
- Q5_0 (32 values, 22 B): d f16, qh u32 (bit i = bit 4 of element i), qs[16] nibbles; w = d * (q - 16).
  -> q8g group 32, codes q - 16, no mins.                                                            EXACT
- Q5_1 (32 values, 24 B): d f16, m f16, qh u32, qs[16] nibbles; w = d * q + m.
  -> q8g group 32, codes 0..31, mins m.                                                              EXACT
- Q8_0 (32 values, 34 B): d f16, qs[32] int8; w = d * q.  -> q8g group 32, no mins.                 EXACT
- Q4_K (256 values, 144 B): d f16, dmin f16, scales[12] (8 six-bit sub-block scales sc and mins m,
  packed: bytes 0-3 / 4-7 hold sc / m of sub-blocks 0-3 in their low 6 bits and the top 2 bits of
  sub-blocks 4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of sc (low nibble) and m (high
  nibble) of sub-blocks 4-7), qs[128]: sub-blocks 2c and 2c+1 are the low and high nibbles of bytes
  32c..32c+31; w = (d * sc) * q - dmin * m.
  -> q4g, codes q, scale fp16(d * sc), min fp16(-dmin * m).                                      BOUNDED
- Q5_K (256 values, 176 B): d, dmin, scales[12] as Q4_K, qh[32] (bit j of byte i = bit 4 of element
  32j + i), qs[128] as Q4_K; w = (d * sc) * q - dmin * m, q in 0..31.
  -> q8g group 32, codes q, scale fp16(d * sc), min fp16(-dmin * m).                               BOUNDED
- Q6_K (256 values, 210 B): ql[128] (each half h of 128 values: elements 0-63 / 64-127 are the low / high
  nibbles of ql[64h .. 64h+63]), qh[64] (bits 2j..2j+1 of qh[32h + i] = bits 4-5 of element
  128h + 32j + i), scales[16] int8 (one per 16 values), d f16; w = (d * sc) * (q - 32).
  -> q8g group 16, codes q - 32, scale fp16(d * sc), no mins.                                      BOUNDED

Exactness of the EXACT types: GGUF computes w in float32 as d * code (+ m); every product of a float16
and an integer of at most 8 bits is exact in float32, and loom's layout computes the same float32
expression (Q4_0: d*q + (-8d) has the exact value d*(q-8), representable, so its rounding is exact too).
The results are therefore equal as numbers; the only bit-level difference is the sign of zero (Q4_0
with q = 8 and d < 0 gives -0.0 in GGUF, +0.0 here).

Error bound of the K-quants (the scale/min rounding to float16). Let p = d * sc (or p = -dmin * m) be the
exact product (exact in float32: at most 11 + 7 significant bits), and fp16(p) its round-to-nearest
float16. For |p| <= 65504 (else ValueError):
    err(p) = |fp16(p) - p| <= 2^-11 * |p|   for normal p (|p| >= 2^-14),
    err(p)                 <= 2^-25         in the float16 subnormal range (|p| < 2^-14, spacing 2^-24),
so err(p) <= max(2^-11 |p|, 2^-25). Subnormal float16 scales/mins are allowed (they are ordinary float16
values to loom's kernels), and in fact the 2^-25 case never rounds: sc, m are integers, so a subnormal p
needs a subnormal d (a multiple of 2^-24) or sc = 0, and is then itself a multiple of 2^-24, i.e. exact.
Hence err(p) <= 2^-11 |p| always. GGUF's value is W_gguf = fl32(E), E = p_s * q + p_m (p_s * q is exact in
float32: at most 17 + 5 significant bits), and loom's is W_loom = fl32(E'), E' = fp16(p_s) * q + fp16(p_m)
(fp16(p_s) * q exact too). Then
    |E' - E| <= |q| * err(p_s) + err(p_m)
and, both roundings being monotone round-to-nearest, |fl32(E') - fl32(E)| <= |E' - E| + ulp32/2 + ulp32/2:
    |W_loom - W_gguf| <= 2^-11 * (|q| * |d sc| + |dmin m|) + 1 ulp32(W)
(with max(2^-11 |p|, 2^-25) in place of 2^-11 |p| if one ignores the exactness of subnormal products):
a relative error of at most 2^-11 ~ 4.9e-4 on each of the two terms of w (|q| <= 15 for Q4_K, 31 for
Q5_K); relative to w itself it can be larger where the two terms cancel. For Q6_K there is no min and
both sides are exact float32 products (p_s has <= 18 bits, |q - 32| <= 32 at most 5), so
    |W_loom - W_gguf| = |q - 32| * err(d * sc) <= 32 * 2^-11 * |d sc|.
Measured on random blocks with realistic scales (tests/quant/test_gguf_repack.py): ~85-100% of the
elements differ, by up to ~0.99 of this bound.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from loom.quant.layout import PackedWeight

# float16's largest finite value: a K-quant scale / min beyond it cannot be stored.
_F16_MAX = 65504.0

# numpy views of one block of each type (field order = byte order; itemsize = GGUF's type size).
_BLOCKS = {
    T.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    T.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    T.Q5_0: np.dtype([("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    T.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    T.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    T.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    T.Q5_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]),
    T.Q6_K: np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
}
_BLOCK_VALUES = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256}

REPACKED_TYPES: frozenset[T] = frozenset(_BLOCKS)


# bytes per weight of loom's layout for each repacked GGML type (codes + float16 scale [+ min] per group)
PACKED_BYTES_PER_WEIGHT: dict[str, float] = {
    "Q4_0": 20 / 32, "Q4_1": 20 / 32, "Q4_K": 20 / 32,  # q4g with mins
    "Q8_0": 34 / 32, "Q5_0": 34 / 32,  # q8g/32 symmetric
    "Q5_1": 36 / 32, "Q5_K": 36 / 32,  # q8g/32 with mins
    "Q6_K": 18 / 16,  # q8g/16 symmetric
}


def repack_gguf(data: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> PackedWeight:
    """Repack one GGUF tensor into loom's layout for its type (see the module docstring for the mapping).

    data: the tensor's raw bytes as `GGUFReader` exposes them (`tensor.data`: for quantized types a
        read-only uint8 view [rows, bytes_per_row] of the file; any C-contiguous array of the right byte
        count is accepted). It is not modified; the result owns fresh memory.
    ggml_type: the tensor's `GGMLQuantizationType`.
    shape: (N, K) in Hugging Face order: N rows, K = GGUF's first (fastest) dimension.

    Raises:
        ValueError: the type is not repacked (F32, F16, BF16, Q2_K, Q3_K, IQ*, ...: keep it dense), the
            byte count or K does not fit the type, or a float16 scale / min would overflow (|value| >
            65504, or it is not finite) — the caller then dequantizes that tensor instead.
    """
    qtype = T(ggml_type)
    if qtype not in _BLOCKS:
        raise ValueError(f"GGML type {qtype.name} is not repacked into a loom layout; keep the tensor dense")
    n, k = (int(d) for d in shape)
    per_block = _BLOCK_VALUES[qtype]
    if n <= 0 or k <= 0 or k % per_block:
        raise ValueError(f"{qtype.name} tensor of shape {(n, k)}: K must be a positive multiple of {per_block}")
    raw = np.ascontiguousarray(data)
    block_dtype = _BLOCKS[qtype]
    if raw.nbytes != n * (k // per_block) * block_dtype.itemsize:
        raise ValueError(
            f"{qtype.name} tensor of shape {(n, k)} needs {n * (k // per_block) * block_dtype.itemsize} bytes, "
            f"got {raw.nbytes}"
        )
    blocks = raw.reshape(-1).view(np.uint8).view(block_dtype).reshape(n, k // per_block)
    return _REPACKERS[qtype](blocks, n, k)


def unpermute_packed_rows(packed: PackedWeight, num_heads: int) -> PackedWeight:
    """`loom.model.loader.gguf.unpermute_rope_rows` for a packed weight: the same reordering of rows
    (dim 0) applied to qweight, scales and mins (rows are independent in both layouts)."""
    from loom.model.loader.gguf import unpermute_rope_rows  # lazy: the loader imports this module

    order = unpermute_rope_rows(torch.arange(packed.shape[0]), num_heads)
    return packed.rows(order)


# ---------------------------------------------------------------------------------------------------------
# per-type repackers: blocks is a structured array [N, K // block_values]


def _f16(blocks: np.ndarray, field: str) -> np.ndarray:
    """A float16 field of every block, as a fresh [N, blocks] array."""
    return np.ascontiguousarray(blocks[field])


def _tensor(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Codes [..., 32] of 16-byte runs in the low-nibble-first order (element i low, i + 16 high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _checked_f16(value: np.ndarray, qtype: T, what: str) -> np.ndarray:
    """float32 `value` (an exact product) rounded to float16; ValueError where it would not fit."""
    bad = ~(np.abs(value) <= _F16_MAX)  # also catches NaN / inf
    if bad.any():
        worst = value[bad].flat[0]
        raise ValueError(
            f"{qtype.name} tensor: a {what} ({worst!r}) does not fit float16 (|value| > {_F16_MAX:g} or not "
            f"finite), so it cannot be repacked; dequantize it instead"
        )
    return value.astype(np.float16)


def _repack_q4_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    d = _f16(blocks, "d")
    mins = _checked_f16(d.astype(np.float32) * np.float32(-8.0), T.Q4_0, "min -8*d")
    qweight = np.ascontiguousarray(blocks["qs"]).reshape(n, k // 2)
    return PackedWeight("q4g", _tensor(qweight), _tensor(d), _tensor(mins), 32)


def _repack_q4_1(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    qweight = np.ascontiguousarray(blocks["qs"]).reshape(n, k // 2)
    return PackedWeight("q4g", _tensor(qweight), _tensor(_f16(blocks, "d")), _tensor(_f16(blocks, "m")), 32)


def _q5_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes 0..31 [N, blocks, 32] uint8."""
    high = np.unpackbits(blocks["qh"], axis=-1, bitorder="little")  # bit i of the u32 = element i
    return _nibbles32(blocks["qs"]) | (high << 4)


def _repack_q5_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    codes = (_q5_codes(blocks).view(np.int8) - np.int8(16)).reshape(n, k)
    return PackedWeight("q8g", _tensor(codes), _tensor(_f16(blocks, "d")), None, 32)


def _repack_q5_1(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    codes = _q5_codes(blocks).view(np.int8).reshape(n, k)
    return PackedWeight("q8g", _tensor(codes), _tensor(_f16(blocks, "d")), _tensor(_f16(blocks, "m")), 32)


def _repack_q8_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    codes = np.ascontiguousarray(blocks["qs"]).reshape(n, k)
    return PackedWeight("q8g", _tensor(codes), _tensor(_f16(blocks, "d")), None, 32)


def _k_scales_mins(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block of 32, (fp16(d * sc), fp16(-dmin * m)) [N, blocks * 8]."""
    packed = blocks["scales"]  # [N, B, 12]
    lo, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [N, B, 8]
    m = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    d = blocks["d"].astype(np.float32)[..., None]
    dmin = blocks["dmin"].astype(np.float32)[..., None]
    n = packed.shape[0]
    scales = _checked_f16(d * sc.astype(np.float32), qtype, "scale d*sc")  # exact float32 products
    mins = _checked_f16(-dmin * m.astype(np.float32), qtype, "min -dmin*m")
    return scales.reshape(n, -1), mins.reshape(n, -1)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K qs [N, B, 128] -> 4-bit codes [N, B, 8, 32] (sub-block 2c: low nibbles of bytes
    32c..32c+31, sub-block 2c+1: their high nibbles)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _repack_q4_k(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    scales, mins = _k_scales_mins(blocks, T.Q4_K)
    # Re-lay each sub-block's 32 bytes-of-nibbles as q4g's 16 bytes: element i low, element i + 16 high.
    qs = blocks["qs"].reshape(n, -1, 4, 2, 16)  # [N, B, c, half of the 32 bytes, 16]
    first, second = qs[..., 0, :], qs[..., 1, :]  # elements 0..15 / 16..31 of sub-blocks 2c, 2c+1
    even = (first & 0x0F) | (second << 4)  # sub-block 2c: low nibbles
    odd = (first >> 4) | (second & 0xF0)  # sub-block 2c+1: high nibbles
    qweight = np.stack([even, odd], axis=-2).reshape(n, k // 2)
    return PackedWeight("q4g", _tensor(qweight), _tensor(scales), _tensor(mins), 32)


def _repack_q5_k(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    scales, mins = _k_scales_mins(blocks, T.Q5_K)
    high = (blocks["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, B, 8, 32]
    codes = (_k_low_nibbles(blocks["qs"]) | (high << 4)).view(np.int8).reshape(n, k)
    return PackedWeight("q8g", _tensor(codes), _tensor(scales), _tensor(mins), 32)


def _repack_q6_k(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    ql = blocks["ql"].reshape(n, -1, 2, 1, 64)  # [N, B, half, 1, 64]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(n, -1, 2, 4, 32)
    qh = blocks["qh"].reshape(n, -1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [N, B, half, 4, 32]
    codes = ((low | (high << 4)).view(np.int8) - np.int8(32)).reshape(n, k)
    d = blocks["d"].astype(np.float32)[..., None]
    scales = _checked_f16(d * blocks["scales"].astype(np.float32), T.Q6_K, "scale d*sc").reshape(n, -1)
    return PackedWeight("q8g", _tensor(codes), _tensor(scales), None, 16)


_REPACKERS = {
    T.Q4_0: _repack_q4_0,
    T.Q4_1: _repack_q4_1,
    T.Q5_0: _repack_q5_0,
    T.Q5_1: _repack_q5_1,
    T.Q8_0: _repack_q8_0,
    T.Q4_K: _repack_q4_k,
    T.Q5_K: _repack_q5_k,
    T.Q6_K: _repack_q6_k,
}
