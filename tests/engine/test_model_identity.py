"""ModelIdentity and SamplingParams.cache_key: the seams the result cache and the router key on."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from loom.engine.model_identity import ModelIdentity, file_sha256, tokenizer_sha256, weights_sha256
from loom.sampling_params import SamplingParams, StructuredOutputParams
from tests.server.fake_engine import FakeTokenizer


def test_weights_hash_follows_the_bytes_and_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights v1")
    first = weights_sha256(model)
    assert first == file_sha256(model, use_cache=False) and any((tmp_path / "cache").rglob("*"))
    stat = model.stat()
    model.write_bytes(b"weights v2")  # same size: a new version of the file under the same name
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weights_sha256(model) != first
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"w")
    (directory / "tokenizer_config.json").write_text('{"chat_template": "a"}')
    (directory / "README.md").write_text("words")
    before = weights_sha256(directory)
    (directory / "README.md").write_text("other words")
    assert weights_sha256(directory) == before  # a README cannot change an answer
    (directory / "tokenizer_config.json").write_text('{"chat_template": "b"}')
    assert weights_sha256(directory) != before


def test_identity_digest_covers_every_field() -> None:
    base = ModelIdentity("m", "a" * 64, "gguf", "float32", "float32", "b" * 64)
    digests = {base.digest}
    for f in dataclasses.fields(base):
        digests.add(dataclasses.replace(base, **{f.name: getattr(base, f.name) + "x"}).digest)
    assert len(digests) == 1 + len(dataclasses.fields(base))
    assert base.card()["digest"] == base.digest
    tok = FakeTokenizer(300)
    assert tokenizer_sha256(tok) == tokenizer_sha256(FakeTokenizer(300))
    assert tokenizer_sha256(tok) != tokenizer_sha256(FakeTokenizer(300, fim=True))


# one changed value per SamplingParams field
_CHANGED = {"n": 2, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {5: 1.0}, "seed": 7, "max_tokens": 17,
            "min_tokens": 1, "stop": ["x"], "stop_token_ids": [3], "ignore_eos": True,
            "include_stop_str_in_output": True, "logprobs": 0, "prompt_logprobs": 0, "skip_special_tokens": False,
            "structured_output": StructuredOutputParams(regex="a+"), "kv_retention": "sinks",
            "kv_retention_budget": 0.5}


def test_cache_key_changes_with_every_field() -> None:
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert set(names) == set(_CHANGED), "a new SamplingParams field: add it to _CHANGED"
    base = SamplingParams()
    keys = {base.cache_key()}
    for name in names:
        keys.add(SamplingParams(**{name: _CHANGED[name]}).cache_key())
    assert len(keys) == 1 + len(names)


def test_cache_key_is_canonical() -> None:
    assert SamplingParams(temperature=0).cache_key() == SamplingParams(temperature=0.0).cache_key()
    assert (SamplingParams(logit_bias={5: 1.0, 2: -1}).cache_key()
            == SamplingParams(logit_bias={2: -1.0, 5: 1}).cache_key())
    assert SamplingParams(stop=["a", "b"]).cache_key() != SamplingParams(stop=["b", "a"]).cache_key()
    schema_ab = StructuredOutputParams(json={"a": 1, "b": 2})
    schema_ba = StructuredOutputParams(json={"b": 2, "a": 1})  # property order orders the output
    assert SamplingParams(structured_output=schema_ab).cache_key() != SamplingParams(
        structured_output=schema_ba).cache_key()
    params = SamplingParams(seed=3, stop=["x"])
    assert params.clone().cache_key() == params.cache_key()
    assert SamplingParams(temperature=0).deterministic and SamplingParams(seed=1).deterministic
    assert not SamplingParams(temperature=0.7).deterministic
