"""What --dtype auto resolves to: float32 for packed-weight methods on CPU (their kernels read the weights at
their own width, so bfloat16 activations would only add rounding), the native choice otherwise."""

from __future__ import annotations

import pytest
import torch

from loom.worker import model_runner
from loom.worker.model_runner import PACKED_CPU_METHODS, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_packed_methods_run_float32_activations_on_cpu(monkeypatch: pytest.MonkeyPatch, native_bf16: bool) -> None:
    monkeypatch.setattr(model_runner, "bf16_is_fast", lambda device: native_bf16)
    for method in PACKED_CPU_METHODS:
        assert resolve_dtype("auto", CPU, method) == torch.float32
    assert resolve_dtype("auto", CPU, None, None) == torch.float32  # the bundled GGUF: quantization gguf
    # dense methods keep the native choice: bfloat16 halves the bytes their weights take
    for method in ("none", "bf16", "fp8"):
        assert resolve_dtype("auto", CPU, method) == (torch.bfloat16 if native_bf16 else torch.float32)


def test_an_explicit_dtype_is_kept() -> None:
    assert resolve_dtype("bfloat16", CPU, "gguf") == torch.bfloat16
    assert resolve_dtype("float32", CPU, "none") == torch.float32
