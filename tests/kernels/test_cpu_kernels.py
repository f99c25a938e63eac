"""loom's C GEMV (loom/kernels/csrc/gemv_bf16.c): numerics against float64, validation, build cache, fallback."""

from __future__ import annotations

import os
import time

import pytest
import torch

from loom.kernels import build, registry
from loom.kernels import cpu as kcpu
from loom.kernels.registry import clear_kernel_cache, get_kernel

gemv = get_kernel("gemv_bf16")
_why_no_gemv = ("this CPU has no AVX512-BF16" if "avx512_bf16" not in build.cpu_flags()
                else "the AVX512-BF16 build is off or did not compile (no C compiler, or LOOM_CPU_KERNELS=0)")
needs_kernel = pytest.mark.skipif(gemv is None, reason=_why_no_gemv)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers around |x| (8 significand bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exp - 7)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 31), (4, 32), (5, 33), (577, 576), (130, 1536), (7, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float64_reference(m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    y32 = gemv(x, w, b, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and y32.shape == (m, n)
    # float32 sums of k exact products: error within k * eps32 * sum|x w|
    bound = k * 2.0 ** -23 * ((x.double().abs() @ w.double().abs().T) + (b.double().abs() if b is not None else 0))
    assert torch.all((y32.double() - ref).abs() <= bound + 1e-30)
    y = gemv(x, w, b)
    assert y.dtype == torch.bfloat16
    # bf16 output = the float32 sum rounded once: within one bf16 ulp of the exact value (plus the sum error)
    assert torch.all((y.double() - ref).abs() <= bf16_ulp(ref) + bound + 1e-30)
    # and exactly the round-to-nearest-even of the kernel's own float32 sum
    assert torch.equal(y, y32.bfloat16())


@needs_kernel
def test_gemv_takes_a_strided_x_and_uses_the_thread_count() -> None:
    x = torch.randn(4, 128).bfloat16()[:, ::2]  # non-contiguous [4, 64]
    w = torch.randn(40, 64).bfloat16()
    ref = (x.float() @ w.float().T)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = gemv(x, w, out_dtype=torch.float32)
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_gemv_rejects_what_it_cannot_read() -> None:
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="multiply"):
        gemv(torch.randn(2, 15).bfloat16(), w)
    with pytest.raises(ValueError, match="bfloat16"):
        gemv(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(2, 16).bfloat16(), torch.randn(16, 8).bfloat16().T)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.randn(2, 16).bfloat16(), w, torch.randn(7).bfloat16())
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(torch.randn(2, 16).bfloat16(), w, out_dtype=torch.float16)
    assert gemv(torch.empty(0, 16, dtype=torch.bfloat16), w).shape == (0, 8)


@needs_kernel
def test_build_is_cached_per_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    first = build.build_library("gemv_bf16", ["gemv_bf16.c"], tag="avx512_bf16")
    assert first.parent == tmp_path / "kernels" and first.exists()
    inode = first.stat().st_ino
    os.utime(first, (1, 1))
    assert build.build_library("gemv_bf16", ["gemv_bf16.c"], tag="avx512_bf16") == first  # not rebuilt,
    assert first.stat().st_ino == inode and first.stat().st_mtime > 1  # and its use recorded
    # builds of other sources: one another checkout used recently is kept, one unused for a week is deleted
    stale = first.parent / "gemv_bf16-avx512_bf16-0000000000000000.so"
    other = first.parent / "gemv_bf16-avx512_bf16-1111111111111111.so"
    stale.write_bytes(b"")
    other.write_bytes(b"")
    week = build.PRUNE_UNUSED_S
    os.utime(stale, (time.time() - week - 60,) * 2)
    os.utime(other, (time.time() - week + 3600,) * 2)
    first.unlink()
    assert build.build_library("gemv_bf16", ["gemv_bf16.c"], tag="avx512_bf16") == first  # rebuilt
    assert not stale.exists() and other.exists()


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.build_library("gemv_bf16", ["gemv_bf16.c"], tag="avx512_bf16")


def test_a_cache_dir_that_cannot_be_made_names_its_variable(tmp_path, monkeypatch) -> None:
    # a bare "[Errno 2] No such file or directory: '/proc/nope'" under paged_decode's name was all a user saw
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LOOM_CACHE_DIR", str(blocker))
    with pytest.raises(OSError, match=r"kernel cache .*a-file/kernels \(LOOM_CACHE_DIR\) cannot be created.*every C kernel"):
        build.cache_dir()


def test_a_missing_compiler_is_reported_once(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    monkeypatch.setattr(build, "cpu_flags", lambda: registry.ISAS["avx512_bf16"].cpu_flags)
    monkeypatch.setattr(registry, "_reported", set())
    clear_kernel_cache()
    try:
        with caplog.at_level("DEBUG", logger="loom.kernels.registry"):
            assert get_kernel("gemv_bf16") is None and get_kernel("paged_decode") is None
            assert get_kernel("fused_ops") is None
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "no C compiler" in warnings[0].getMessage()
    finally:
        monkeypatch.undo()
        clear_kernel_cache()


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_kernels_can_be_switched_off(monkeypatch, value: str) -> None:
    """Any off word (only exactly "0" used to switch them off; "off" left them on, silently)."""
    monkeypatch.setenv("LOOM_CPU_KERNELS", value)
    clear_kernel_cache()
    try:
        assert get_kernel("gemv_bf16") is None
        assert get_kernel("fused_ops") is None and get_kernel("fused_ops", isa="generic") is None  # built anywhere
        from loom.model.layers.linear import OneDNNPackedLinearMethod, default_linear_method
        method = default_linear_method(torch.bfloat16, torch.device("cpu"))
        assert not isinstance(method, OneDNNPackedLinearMethod) or method.gemv is None
    finally:
        monkeypatch.delenv("LOOM_CPU_KERNELS")
        clear_kernel_cache()
    assert (get_kernel("gemv_bf16") is None) == (gemv is None)


@needs_kernel
def test_linear_layer_routes_decode_rows_to_the_kernel() -> None:
    from loom.model.layers.linear import Linear, OneDNNPackedLinearMethod, onednn_packing_available

    if not onednn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 on this CPU")
    layer = Linear(64, 48, bias=True, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert isinstance(layer.quant_method, OneDNNPackedLinearMethod) and layer.quant_method.gemv is not None
    torch.manual_seed(0)
    layer.weight.data.copy_(torch.randn(48, 64))
    layer.bias.data.copy_(torch.randn(48))
    layer.process_weights_after_loading()
    for rows in (1, kcpu.GEMV_MAX_ROWS, kcpu.GEMV_MAX_ROWS + 1, 32):
        x = torch.randn(rows, 64).bfloat16()
        ref = x.double() @ layer.weight.double().T + layer.bias.double()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        assert torch.all((y.double() - ref).abs() <= 2 * bf16_ulp(ref) + 1e-2), rows
        if rows <= kcpu.GEMV_MAX_ROWS:
            assert torch.equal(y, gemv(x, layer.weight, layer.bias))


def test_no_kernel_when_the_cpu_lacks_bf16(monkeypatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    clear_kernel_cache()
    try:
        assert get_kernel("gemv_bf16") is None
    finally:
        monkeypatch.undo()
        clear_kernel_cache()


def test_a_kernel_switch_that_is_no_on_off_value_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("LOOM_CPU_KERNELS", "torch")
    clear_kernel_cache()
    try:
        with pytest.raises(ValueError, match="LOOM_CPU_KERNELS='torch'"):
            get_kernel("fused_ops")
    finally:
        monkeypatch.delenv("LOOM_CPU_KERNELS")
        clear_kernel_cache()
