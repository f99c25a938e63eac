"""`loom bench longctx`: the passkey and multi-document datasets, scoring, the KV accounting and a small run on
the bundled model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loom.bench.longctx import (
    PASSKEY_ANSWER_PREFIX, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, PROMPT_FORMATS, SNAP_TOKENS, AustenProse,
    build_samples, extract_answer, multidoc_sample, passkey_sample, prompt_frame, score,
)  # fmt: skip
from loom.bench.longctx_run import retention_kept_tokens, sparse_read_tokens, topk_for_fraction


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a transformers tokenizer
    from loom.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prose(tokenizer) -> AustenProse:  # noqa: ANN001
    try:
        return AustenProse(tokenizer)  # reads each novel when first used
    except RuntimeError as e:  # the Debian package cannot be had here: a missing resource, not a loom failure
        pytest.skip(f"Jane Austen novels unavailable: {e}")


@pytest.mark.parametrize("length", [300, 2048])
@pytest.mark.parametrize("prompt_format", PROMPT_FORMATS)
def test_passkey_exact_length_needle_and_depth(prose: AustenProse, length: int, prompt_format: str) -> None:
    samples = build_samples(prose, "passkey", length, 5, seed=3, prompt_format=prompt_format)
    tok = prose.tokenizer
    assert [s.depth for s in samples] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    assert len({s.answer for s in samples}) == 5
    for s in samples:
        assert s.num_tokens == length
        assert re.fullmatch(r"\d{5}", s.answer)
        text = tok.decode(s.prompt_token_ids)
        assert f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key." in text
        assert text.count(s.answer) == 2  # only in the needle
        at = s.needle_positions[0]
        assert tok.decode(s.prompt_token_ids[at:at + 6]).startswith(" The pass key is")
        # the needle sits at its depth of the haystack, give or take the move to a sentence end
        frame = prompt_frame(prose, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, PASSKEY_ANSWER_PREFIX, prompt_format)
        needle_len = len(prose.encode(f" The pass key is {s.answer}. Remember it. {s.answer} is the pass key."))
        hay_len = length - len(frame.prefix) - len(frame.suffix) - needle_len
        assert abs((at - len(frame.prefix)) - s.depth * hay_len) <= SNAP_TOKENS + 1
        assert s.prompt_token_ids[:len(frame.prefix)] == frame.prefix
        assert s.prompt_token_ids[-len(frame.suffix):] == frame.suffix


def test_passkey_needle_follows_a_sentence_end(prose: AustenProse) -> None:
    tok = prose.tokenizer
    for s in build_samples(prose, "passkey", 2048, 4, seed=1):
        at = s.needle_positions[0]
        before = tok.decode(s.prompt_token_ids[at - 1:at]).rstrip()
        assert before.endswith((".", "!", "?", '"', "'")), before


def test_deterministic_by_seed(prose: AustenProse) -> None:
    a = build_samples(prose, "passkey", 512, 3, seed=7)
    b = build_samples(prose, "passkey", 512, 3, seed=7)
    c = build_samples(prose, "passkey", 512, 3, seed=8)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    assert [s.answer for s in a] != [s.answer for s in c]
    m1 = build_samples(prose, "multidoc", 1024, 2, seed=7)
    m2 = build_samples(prose, "multidoc", 1024, 2, seed=7)
    assert [s.prompt_token_ids for s in m1] == [s.prompt_token_ids for s in m2]


@pytest.mark.parametrize("length", [512, 4096])
def test_multidoc_documents_and_unique_keys(prose: AustenProse, length: int) -> None:
    tok = prose.tokenizer
    for i in range(3):
        s = multidoc_sample(prose, length, i, num_docs=4, num_keys=4, seed=0)
        assert s.num_tokens == length
        assert len(s.books) == len(set(s.books)) == 4  # one novel per document
        assert len(s.keys) == 4 and len(set(s.keys.values())) == 4
        assert s.keys[s.query_key] == s.answer and re.fullmatch(r"\d{7}", s.answer)
        text = tok.decode(s.prompt_token_ids)
        for d in range(1, 5):
            assert text.count(f"Document {d}:\n") == 1
        for name, number in s.keys.items():
            assert f"The special magic number for {name} is {number}." in text
            assert text.count(number) == 1
        assert f"What is the special magic number for {s.query_key}" in text
        assert len(set(s.needle_positions)) == 4 and 0 < s.depth < 1
        # needles land in distinct documents
        starts = [text.index(f"Document {d}:") for d in range(1, 5)] + [len(text)]
        docs = {next(d for d in range(4) if starts[d] <= text.index(n) < starts[d + 1]) for n in s.keys.values()}
        assert len(docs) == 4


def test_dataset_errors(prose: AustenProse) -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        passkey_sample(prose, 80, 0, 1)
    with pytest.raises(ValueError, match="num_docs"):
        multidoc_sample(prose, 2048, 0, num_docs=7)
    with pytest.raises(ValueError, match="task"):
        build_samples(prose, "summarize", 512, 1)
    with pytest.raises(ValueError, match="prompt_format"):
        passkey_sample(prose, 512, 0, 1, prompt_format="markdown")


def test_scoring() -> None:
    assert extract_answer(" 48213. Remember") == "48213"
    assert score(" 48213.", "48213")
    assert score("The pass key is 48213", "48213")
    assert not score(" 482135", "48213")  # a longer run is not the key
    assert not score(" 4821", "48213")
    assert not score(" 11111 then 48213", "48213")  # the first number counts
    assert not score("I do not know", "48213") and extract_answer("none") is None


def test_kv_accounting() -> None:
    # a quarter of 4096 prompt tokens: 1024 tokens, above the protected sink + newest + window blocks
    assert retention_kept_tokens(4096, 12, 0.25, 16, 4, 32) == 1024
    assert retention_kept_tokens(4096, 12, 300, 16, 4, 32) == 300
    assert retention_kept_tokens(100, 5, 0.125, 16, 4, 32) == 64  # protected: 1 sink + 1 newest + 2 window blocks
    assert retention_kept_tokens(40, 2, 0.125, 16, 4, 32) == 41  # never more than the context
    assert sparse_read_tokens(4107, 61, 16, 1, 2) == 1024
    assert topk_for_fraction(0.25, 4096, 16, 1, 2) == 61 and topk_for_fraction(0.001, 4096, 16, 1, 2) == 1


def _run_cli(tmp_path: Path, *extra: str) -> dict:
    import argparse

    from loom.bench.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "longctx.json"
    ns = parser.parse_args(["bench", "longctx", "--lengths", "256", "--num-samples", "2", "--num-docs", "2",
                            "--num-keys", "2", "--output-json", str(out), "--plot", str(tmp_path / "acc.png"), *extra])
    assert ns.func(ns) == 0
    return json.loads(out.read_text())  # FileNotFoundError when the command wrote no JSON


def test_end_to_end_full_attention(tmp_path: Path, capsys: pytest.CaptureFixture, prose: AustenProse) -> None:
    data = _run_cli(tmp_path, "--policies", "full")
    rows = data["rows"]
    assert [(r["task"], r["policy"]) for r in rows] == [("multidoc", "full"), ("passkey", "full")]
    for r in rows:
        assert r["prompt_tokens"] == 256 and r["num_samples"] == 2 and len(r["answers"]) == 2
        assert 0 <= r["accuracy"] <= 1 and r["ttft_s_median"] > 0
        assert r["kv_tokens_median"] >= 256 and r["kv_bytes_median"] > 0
        assert r["budget_fraction"] >= 1
    assert (tmp_path / "acc.png").stat().st_size > 0
    assert "| passkey | 256 | 256 | full |" in capsys.readouterr().out
    # --from-json re-plots earlier results without running anything
    (tmp_path / "acc.png").unlink()
    (tmp_path / "longctx.json").rename(tmp_path / "earlier.json")
    with pytest.raises(FileNotFoundError):
        _run_cli(tmp_path, "--from-json", str(tmp_path / "earlier.json"))  # no new JSON is written
    assert (tmp_path / "acc.png").stat().st_size > 0
    assert "| multidoc | 256 | 256 | full |" in capsys.readouterr().out


def test_cli_refuses_engine_wide_retention(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--kv-retention"):
        _run_cli(tmp_path, "--kv-retention", "sinks")
    with pytest.raises(ValueError, match="--budgets"):
        _run_cli(tmp_path, "--budgets", "0")


def test_end_to_end_lossy_policy(tmp_path: Path, prose: AustenProse) -> None:
    """sinks at half the prompt: the KV kept (from the engine's dropped-block counter) is about half of full's."""
    rows = _run_cli(tmp_path, "--tasks", "passkey", "--policies", "full", "sinks", "snapkv", "--budgets", "0.5")["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("sinks", 0.5), ("snapkv", 0.5)]
    full, *lossy = rows
    for r in lossy:
        assert r["kv_tokens_median"] <= 128 + 16 < full["kv_tokens_median"]  # budget, then the decode's own block
        assert 0.4 < r["budget_fraction"] < 0.6
        assert r["cached_tokens_median"] > 0  # the exact prefill came from full attention's cached blocks


def test_end_to_end_topk_blocks_in_its_own_engine(tmp_path: Path, prose: AustenProse) -> None:
    rows = _run_cli(tmp_path, "--tasks", "passkey", "--policies", "full", "topk-blocks", "--budgets", "0.5")["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("topk-blocks", 5.0)]  # 8 blocks: 5 + 1 + 2
    assert rows[1]["kv_tokens_median"] == 128 and rows[1]["budget_fraction"] == 0.5
