"""GGUF quant types repacked into loom's layouts: equal to the gguf library's own dequantization (bit for
bit for the legacy types, within the proven float16 bound for the K-quants), on random blocks and on the
real bundled model."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loom.model.loader.gguf import gguf_arch_config, unpermute_rope_rows
from loom.quant.gguf_repack import REPACKED_TYPES, repack_gguf, unpermute_packed_rows
from loom.quant.layout import PackedWeight, dequantize, unpack_codes

LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# Byte offsets of each type's float16 fields inside a block (ggml's block structs); the rest is codes
# and packed sub-block scales, where every bit pattern is valid.
F16_OFFSETS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
LAYOUT = {T.Q4_0: ("q4g", 32, True), T.Q4_1: ("q4g", 32, True), T.Q5_0: ("q8g", 32, False),
          T.Q5_1: ("q8g", 32, True), T.Q8_0: ("q8g", 32, False), T.Q4_K: ("q4g", 32, True),
          T.Q5_K: ("q8g", 32, True), T.Q6_K: ("q8g", 16, False)}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run on one torch thread: these are large elementwise passes, and two intra-op threads on a
    loaded 2-core machine are ~10x slower (measured) than one."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def random_f16(rng: np.random.Generator, shape, lo: float = 1e-3, hi: float = 1e-1) -> np.ndarray:
    """Random normal float16 values of magnitude ~lo..hi (both signs), no NaN / inf."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(np.log10(lo), np.log10(hi), shape)).astype(np.float16)


def random_blocks(rng: np.random.Generator, qtype: T, n: int, k: int, **scale_range) -> np.ndarray:
    """Valid random GGUF data [n, bytes_per_row] uint8 (as GGUFReader's tensor.data): random bytes, with
    every float16 field replaced by a finite random value."""
    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block_values, type_size), dtype=np.uint8)
    for offset in F16_OFFSETS[qtype]:
        blocks[..., offset:offset + 2] = random_f16(rng, (n, k // block_values), **scale_range)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def bits(w) -> np.ndarray:
    """float32 bit patterns, with -0.0 folded into +0.0 (the one allowed difference, see gguf_repack)."""
    return (np.asarray(w, dtype=np.float32) + np.float32(0.0)).view(np.int32)


def check_layout(packed: PackedWeight, qtype: T, n: int, k: int) -> None:
    layout, group, has_mins = LAYOUT[qtype]
    assert (packed.layout, packed.group_size, packed.shape, packed.mins is not None) == (layout, group, (n, k), has_mins)


# --- legacy types: exact --------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("k", [32, 96])
def test_legacy_types_bit_exact(qtype: T, n: int, k: int) -> None:
    rng = np.random.default_rng(1000 * n + k + int(qtype))
    random_data = random_blocks(rng, qtype, n, k)
    quantized = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    assert quantized.dtype == np.uint8 and quantized.shape == random_data.shape
    for data in (random_data, quantized):
        packed = repack_gguf(data, qtype, (n, k))
        check_layout(packed, qtype, n, k)
        want = gguf.quants.dequantize(data, qtype)
        assert np.array_equal(bits(dequantize(packed)), bits(want))


def test_q4_0_negative_zero_is_the_only_bit_difference() -> None:
    # d < 0 and code 8: gguf gives d * 0 = -0.0, the layout d*8 + (-8d) = +0.0 (equal as numbers).
    data = np.zeros((1, 18), dtype=np.uint8)
    data[0, :2] = np.array([-0.5], dtype=np.float16).view(np.uint8)
    data[0, 2:] = 0x88
    packed = repack_gguf(data, T.Q4_0, (1, 32))
    want = gguf.quants.dequantize(data, T.Q4_0)
    assert np.signbit(want).all() and np.array_equal(dequantize(packed).numpy(), want)


# --- K-quants: within the float16 bound ----------------------------------------------------------------


def k_quant_terms(data: np.ndarray, qtype: T, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """|d * sc| and |dmin * m| per element [n, k] (float64), decoded with the gguf library's helpers."""
    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)
    if qtype == T.Q6_K:
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)
        scale = np.abs(d * blocks[:, 192:208].view(np.int8).astype(np.float64))  # [blocks, 16]
        return np.repeat(scale, 16, axis=1).reshape(n, k), np.zeros((n, k))
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scale, minimum = np.abs(d * sc), np.abs(dmin * m)  # [blocks, 8]
    return np.repeat(scale, 32, axis=1).reshape(n, k), np.repeat(minimum, 32, axis=1).reshape(n, k)


def k_quant_bound(data: np.ndarray, qtype: T, packed: PackedWeight, w_loom: np.ndarray, w_gguf: np.ndarray) -> np.ndarray:
    """The module docstring's bound: |q| err(d sc) + err(dmin m) + one float32 ulp (no ulp for Q6_K),
    err(p) <= 2^-11 |p| (its sharp form: a float16-subnormal product of these integers is exact)."""
    n, k = packed.shape
    scale, minimum = k_quant_terms(data, qtype, n, k)
    q = np.abs(unpack_codes(packed).numpy().astype(np.float64))
    bound = q * 2.0**-11 * scale
    if qtype != T.Q6_K:
        bound += 2.0**-11 * minimum
        bound += 0.5 * (np.spacing(np.abs(w_loom)) + np.spacing(np.abs(w_gguf))).astype(np.float64)
    return bound


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("scales", ["realistic", "tiny"])  # tiny: d, d*sc around float16's subnormals
def test_k_quants_within_bound(qtype: T, n: int, k: int, scales: str) -> None:
    rng = np.random.default_rng(1000 * n + k + int(qtype))
    scale_range = {"lo": 1e-3, "hi": 1e-1} if scales == "realistic" else {"lo": 1e-8, "hi": 1e-4}
    data = random_blocks(rng, qtype, n, k, **scale_range)
    packed = repack_gguf(data, qtype, (n, k))
    check_layout(packed, qtype, n, k)
    w_loom = dequantize(packed).numpy()
    w_gguf = gguf.quants.dequantize(data, qtype)
    err = np.abs(w_loom.astype(np.float64) - w_gguf.astype(np.float64))
    bound = k_quant_bound(data, qtype, packed, w_loom, w_gguf)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    differ = err > 0
    ratio = (err[differ] / bound[differ]).max() if differ.any() else 0.0
    rel = (err[differ] / np.abs(w_gguf[differ]).astype(np.float64)).max() if differ.any() else 0.0
    print(f"{qtype.name} {n}x{k} {scales}: {np.count_nonzero(differ)}/{err.size} elements differ, "
          f"max abs {err.max():.3g}, max rel {rel:.3g}, max err/bound {ratio:.3f}")


@pytest.mark.parametrize(("qtype", "d"), [(T.Q4_K, 60000.0), (T.Q5_K, 60000.0), (T.Q6_K, 2000.0), (T.Q4_0, 10000.0)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_float16_overflow_raises(qtype: T, d: float) -> None:
    rng = np.random.default_rng(0)
    k = gguf.GGML_QUANT_SIZES[qtype][0]
    data = random_blocks(rng, qtype, 1, k)
    data[0, F16_OFFSETS[qtype][0]:F16_OFFSETS[qtype][0] + 2] = np.array([d], dtype=np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        data[0, 192:208] = 100  # d * sc = 2e5
    elif qtype != T.Q4_0:
        data[0, 4:16] = 0xFF  # every sc and m = 63
    with pytest.raises(ValueError, match=qtype.name):
        repack_gguf(data, qtype, (1, k))


# --- unsupported types, bad input ------------------------------------------------------------------------


def test_repacked_types() -> None:
    assert REPACKED_TYPES == frozenset(LEGACY + K_QUANTS)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ2_XXS, T.Q8_1],
                         ids=lambda t: t.name)
def test_unsupported_types_raise(qtype: T) -> None:
    with pytest.raises(ValueError, match="not repacked"):
        repack_gguf(np.zeros((4, 1024), dtype=np.uint8), qtype, (4, 256))


def test_wrong_size_raises() -> None:
    with pytest.raises(ValueError, match="bytes"):
        repack_gguf(np.zeros((2, 20), dtype=np.uint8), T.Q4_1, (2, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_gguf(np.zeros((1, 144), dtype=np.uint8), T.Q4_K, (1, 128))


# --- rope row un-permutation ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_1, T.Q6_K], ids=lambda t: t.name)
def test_unpermute_packed_rows_random(qtype: T) -> None:
    n, k, heads = 64, 256, 4
    data = random_blocks(np.random.default_rng(7), qtype, n, k)
    packed = repack_gguf(data, qtype, (n, k))
    got = unpermute_packed_rows(packed, heads)
    assert (got.layout, got.group_size) == (packed.layout, packed.group_size)
    assert torch.equal(dequantize(got), unpermute_rope_rows(dequantize(packed), heads))


# --- the real bundled model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader(default_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(default_gguf))


def hf_shape(tensor) -> tuple[int, int]:
    return int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dims fastest-first


def test_bundled_model_bit_exact(reader: gguf.GGUFReader) -> None:
    tensors = [t for t in reader.tensors if t.tensor_type in REPACKED_TYPES]
    assert {t.tensor_type for t in tensors} == {T.Q4_1, T.Q8_0}
    assert sum(t.tensor_type == T.Q4_1 for t in tensors) == 210 and len(tensors) == 211
    for tensor in tensors:
        # GGUFReader's view of a quantized tensor: read-only uint8 [rows, bytes_per_row] over the mmap
        assert tensor.data.dtype == np.uint8 and tensor.data.ndim == 2 and not tensor.data.flags.writeable
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's warning on a non-writable numpy array
            packed = repack_gguf(tensor.data, tensor.tensor_type, hf_shape(tensor))
        check_layout(packed, tensor.tensor_type, *hf_shape(tensor))
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(dequantize(packed).view(torch.int32), want.view(torch.int32)), tensor.name


def test_bundled_model_unpermuted_rope_rows(reader: gguf.GGUFReader) -> None:
    arch = gguf_arch_config(reader)
    checked = 0
    for tensor in reader.tensors:
        stem = tensor.name.rsplit(".", 2)[-2]
        if stem not in ("attn_q", "attn_k"):
            continue
        heads = arch.num_heads if stem == "attn_q" else arch.num_kv_heads
        packed = unpermute_packed_rows(repack_gguf(tensor.data, tensor.tensor_type, hf_shape(tensor)), heads)
        dense = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(dequantize(packed), unpermute_rope_rows(dense, heads)), tensor.name
        checked += 1
    assert checked == 2 * arch.num_layers
