"""What --dtype auto resolves to: float32 for packed-weight methods on CPU (their kernels read the weights at
their own width, so bfloat16 activations would only add rounding), the native choice otherwise."""

from __future__ import annotations

import pytest
import torch

from loom.kernels.registry import clear_kernel_cache, get_kernel
from loom.worker import model_runner
from loom.worker.model_runner import PACKED_CPU_METHODS, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_packed_methods_run_float32_activations_on_cpu(monkeypatch: pytest.MonkeyPatch, native_bf16: bool) -> None:
    monkeypatch.setattr(model_runner, "bf16_is_fast", lambda device: native_bf16)
    for method in PACKED_CPU_METHODS:
        if method != "fp8":
            assert resolve_dtype("auto", CPU, method) == torch.float32
    assert resolve_dtype("auto", CPU, None, None) == torch.float32  # the bundled GGUF: quantization gguf
    # fp8's weights stay e4m3 under float32 activations where loom's gemv_fp8 runs; without it they are widened at
    # load, a dense model
    fp8_kernel = get_kernel("gemv_fp8") is not None
    assert resolve_dtype("auto", CPU, "fp8") == (torch.float32 if fp8_kernel or not native_bf16 else torch.bfloat16)
    monkeypatch.setenv("LOOM_CPU_KERNELS", "0")
    clear_kernel_cache()
    try:
        assert resolve_dtype("auto", CPU, "fp8") == (torch.bfloat16 if native_bf16 else torch.float32)
    finally:
        monkeypatch.delenv("LOOM_CPU_KERNELS")
        clear_kernel_cache()
    # dense methods keep the native choice: bfloat16 halves the bytes their weights take
    for method in ("none", "bf16"):
        assert resolve_dtype("auto", CPU, method) == (torch.bfloat16 if native_bf16 else torch.float32)


def test_an_explicit_dtype_is_kept() -> None:
    assert resolve_dtype("bfloat16", CPU, "gguf") == torch.bfloat16
    assert resolve_dtype("float32", CPU, "none") == torch.float32


def test_packed_weights_on_cpu_get_a_float16_kv_cache_by_default() -> None:
    """--kv-cache-dtype auto: float16 under packed float32 weights on the CPU (llama.cpp's KV type: half the bytes
    a decode step streams), the model dtype everywhere else, and an explicit choice kept."""
    from loom.attention.kv_quant import resolve_kv_cache_dtype
    from loom.worker.model_runner import packed_on_cpu

    assert packed_on_cpu(CPU, None, None)  # the bundled GGUF runs as "gguf"
    assert packed_on_cpu(CPU, "w4a16", None) and not packed_on_cpu(CPU, "none", None)
    assert not packed_on_cpu(torch.device("cuda"), "gguf", None)
    assert resolve_kv_cache_dtype("auto", torch.float32, packed_cpu=True) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, packed_cpu=False) == torch.float32  # the oracle path
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, packed_cpu=True) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, packed_cpu=True) == torch.float32


def test_the_engine_runs_the_bundled_model_over_a_float16_cache() -> None:
    from loom.config import CacheConfig, ModelConfig
    from loom.worker.model_runner import ModelRunner

    small = dict(num_blocks=8)
    packed = ModelRunner(ModelConfig(), CacheConfig(**small), CPU)
    assert packed.kv_cache_dtype == torch.float16 and packed.kv_caches[0].dtype == torch.float16
    assert packed.model.model.decode_step is not None  # the one-call C step serves the float16 cache
    oracle = ModelRunner(ModelConfig(quantization="none", dtype="float32"), CacheConfig(**small), CPU)
    assert oracle.kv_cache_dtype == torch.float32


@pytest.mark.parametrize(("flags", "native"), [
    (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}), False),  # Ice Lake: oneDNN emulates bf16
    (frozenset({"avx2", "fma"}), False),  # Zen 3
    (frozenset({"avx512f", "avx512_bf16"}), True),  # Zen 4, Cooper Lake
    (frozenset({"avx512f", "amx_bf16"}), True),  # Sapphire Rapids
    (frozenset(), True),  # no flags listed (not Linux x86): oneDNN decides
])
def test_bf16_is_native_only_on_a_cpu_that_lists_it(monkeypatch: pytest.MonkeyPatch, flags: frozenset,
                                                   native: bool) -> None:
    """oneDNN says bf16 is supported on plain AVX-512 too, where it is emulated; `auto` took bfloat16 there and ran
    a bf16 checkpoint at half the speed of float32 activations."""
    from loom.kernels import build

    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert model_runner.bf16_is_fast(CPU) is native
    assert resolve_dtype("auto", CPU, "bf16") == (torch.bfloat16 if native else torch.float32)
