"""Incremental detokenizer against the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from loom.engine.detokenizer import IncrementalDetokenizer, backend_tokenizer, decode_token

TEXTS = [
    "Hello world",
    "Grüße aus Köln, señor — café crème brûlée.",
    "日本語のテキストと中文字符，还有한국어.",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 and 🤖!",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "mixed ✓ ∑ ∞ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
]


def stream_text(tokenizer, prompt_ids: list[int], ids: list[int], skip: bool = True) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.step(t) for t in ids]
    deltas.append(detok.flush())
    return "".join(deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_valid_text_round_trips_without_replacement_chars(hf_tokenizer, text: str) -> None:
    prompt_ids = hf_tokenizer.encode("Say something:")
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    joined, deltas = stream_text(hf_tokenizer, prompt_ids, ids)
    assert joined == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)


def test_split_character_is_emitted_once_complete(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji's bytes span several tokens in this vocabulary
    detok = IncrementalDetokenizer(hf_tokenizer, [], skip_special_tokens=True)
    deltas = [detok.step(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_random_token_sequences_match_decode(hf_tokenizer) -> None:
    rng = random.Random(0)
    vocab = len(backend_tokenizer(hf_tokenizer).get_vocab())
    for _ in range(30):
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            joined, _ = stream_text(hf_tokenizer, prompt_ids, ids, skip)
            assert joined == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_is_flushed_like_decode(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("ab😀", add_special_tokens=False)[:-1]  # drop the emoji's last piece
    joined, deltas = stream_text(hf_tokenizer, [], ids)
    assert joined == hf_tokenizer.decode(ids)
    assert "\ufffd" in deltas[-1]  # only the flush shows the broken character


def test_special_tokens_skipped_or_kept(hf_tokenizer) -> None:
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = hf_tokenizer.encode("Hi there", add_special_tokens=False) + [eos]
    assert stream_text(hf_tokenizer, [], ids, skip=True)[0] == "Hi there"
    assert stream_text(hf_tokenizer, [], ids, skip=False)[0] == "Hi there<|im_end|>"


def test_first_token_decodes_in_prompt_context(hf_tokenizer) -> None:
    full = hf_tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    prompt_ids, output_ids = full[:3], full[3:]
    joined, deltas = stream_text(hf_tokenizer, prompt_ids, output_ids)
    assert deltas[0].startswith(" ")  # " fox": the leading space survives
    assert joined == hf_tokenizer.decode(full)[len(hf_tokenizer.decode(prompt_ids)):]


def test_decode_token(hf_tokenizer) -> None:
    (world,) = hf_tokenizer.encode(" world", add_special_tokens=False)
    assert decode_token(hf_tokenizer, world) == " world"
    assert decode_token(hf_tokenizer, hf_tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


def test_slow_tokenizer_rejected() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        IncrementalDetokenizer(object(), [], skip_special_tokens=True)
