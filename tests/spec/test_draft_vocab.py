"""The draft model's frequency-ranked vocabulary (FR-Spec): the ranking, the token counts and their cache, the LM head
restricted to the chosen rows (packed and dense, tied or not), and the engine's output unchanged with it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from loom import LLM, SamplingParams
from loom.config import CacheConfig, ModelConfig
from loom.spec.draft_model import DraftModelProposer
from loom.config import EngineArgs
from loom.spec.draft_vocab import (corpus_files, default_corpus, draft_vocabulary, restrict_lm_head,
                                   special_token_ids, token_counts)
from loom.worker.model_runner import ModelRunner
from tests.helpers import run_engine_checked, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_vocab")
    return {
        "target": save_tiny_model(root / "target", "llama", hf_tokenizer, seed=0),
        "draft": save_tiny_model(root / "draft", "llama", hf_tokenizer, seed=1, num_hidden_layers=1),
        "tied": save_tiny_model(root / "tied", "llama", hf_tokenizer, seed=2, tie_word_embeddings=True),
    }


def _runner(path: Path, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(ModelConfig(model=str(path), dtype="float32", quantization=quantization),
                       CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False), torch.device("cpu"))


def test_the_vocabulary_is_the_most_frequent_ids_plus_the_ones_always_kept() -> None:
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
    assert draft_vocabulary(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert draft_vocabulary(counts, 3, always=[7, 6, 2, 99]).tolist() == [0, 2, 5, 6, 7]  # 99: out of range
    assert draft_vocabulary(counts, 100).tolist() == list(range(8))
    with pytest.raises(ValueError, match="speculative_draft_vocab_size must be >= 1, got 0"):
        draft_vocabulary(counts, 0)


def test_token_counts_are_the_corpus_tokens_and_the_cache_follows_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_tokenizer) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n")
    (corpus / "b.txt").write_text("The quick brown fox. The end.")
    (corpus / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix: left out
    assert [p.name for p in corpus_files(str(corpus))] == ["a.py", "b.txt"]
    vocab = len(hf_tokenizer)
    counts = token_counts(hf_tokenizer, vocab, str(corpus))
    expected = np.zeros(vocab, dtype=np.int64)
    for text in ("def f(x):\n    return x + 1\n", "The quick brown fox. The end."):
        np.add.at(expected, hf_tokenizer.encode(text, add_special_tokens=False), 1)
    assert np.array_equal(counts, expected) and counts.sum() > 0
    assert len(list((tmp_path / "cache" / "draft_vocab").glob("*.npy"))) == 1
    assert np.array_equal(token_counts(hf_tokenizer, vocab, str(corpus)), expected)  # from the cache
    (corpus / "b.txt").write_text("one one one one one one")  # new size and time: counted again
    again = np.zeros(vocab, dtype=np.int64)
    for text in ("def f(x):\n    return x + 1\n", "one one one one one one"):
        np.add.at(again, hf_tokenizer.encode(text, add_special_tokens=False), 1)
    assert np.array_equal(token_counts(hf_tokenizer, vocab, str(corpus)), again)
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        corpus_files(str(tmp_path / "missing"))
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        token_counts(hf_tokenizer, vocab, str(tmp_path / "blank.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        corpus_files(str(tmp_path / "empty"))


def test_the_default_corpus_is_the_standard_librarys_source_without_its_tests() -> None:
    files = default_corpus()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert any(f.name == "textwrap.py" for f in files)
    assert not any("test" in f.parts[:-1] or "site-packages" in f.parts for f in files)


@pytest.mark.parametrize(("model", "quantization"), [("target", None), ("target", "w4a16"), ("tied", None),
                                                     ("tied", "w8a16")])
def test_the_restricted_head_gives_the_full_heads_logits_on_its_ids(
        tiny_dirs: dict[str, Path], model: str, quantization: str | None) -> None:
    runner = _runner(tiny_dirs[model], quantization)
    m = runner.model
    vocab = runner.arch.vocab_size
    hidden = torch.randn(5, runner.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    full = m.compute_logits(hidden)
    embedding = m.model.embed_tokens.weight.detach().clone() if m.model.embed_tokens.weight is not None else None
    ids = torch.tensor(sorted({0, 3, 17, 200, 4095, vocab - 1, *range(1000, 1100)}))
    restrict_lm_head(m, ids)
    got = m.compute_logits(hidden)
    assert got.shape == (5, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-6, atol=1e-6)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    assert torch.equal(got.argmax(-1), ids[full[:, ids].argmax(-1)])
    if embedding is not None:  # a tied embedding keeps every row
        assert torch.equal(m.model.embed_tokens.weight, embedding)
    with pytest.raises(ValueError, match="ids in"):
        restrict_lm_head(_runner(tiny_dirs[model], quantization).model, torch.tensor([vocab]))


def test_drafts_come_from_the_vocabulary_and_the_output_is_unchanged(tiny_dirs: dict[str, Path], hf_tokenizer,
                                                                     tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three four five six seven eight nine ten. " * 20 + "def f(x):\n    return x\n")
    prompts = [hf_tokenizer.encode(t) for t in ("one two three four", "def f(x):\n    return", "The end")]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = run_engine_checked(LLM(model=str(tiny_dirs["target"]), dtype="float32").engine, prompts, params)
    for draft in ("target", "draft"):
        llm = LLM(model=str(tiny_dirs["target"]), dtype="float32", speculative_method="draft_model",
                  speculative_model=str(tiny_dirs[draft]), num_speculative_tokens=4,
                  speculative_disable_by_batch_size=None, speculative_draft_vocab_size=16,
                  speculative_draft_vocab_corpus=str(corpus), block_size=4, num_kv_blocks=24,
                  max_num_batched_tokens=12)  # preemption and chunked prefill
        assert run_engine_checked(llm.engine, prompts, params) == expected
        proposer: DraftModelProposer = llm.engine.scheduler.proposer
        vocabulary = set(proposer.runner.model.draft_vocabulary.tolist())
        specials = set(special_token_ids(hf_tokenizer))
        assert specials <= vocabulary and 16 < len(vocabulary) <= 16 + len(specials)
        assert set(proposer.propose("x", prompts[0], 4)) <= vocabulary
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        assert proposer.num_free_blocks == proposer.runner.num_blocks - len(proposer._states["x"].blocks)


def test_bad_draft_vocabulary_settings_are_refused(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    target = str(tiny_dirs["target"])
    with pytest.raises(ValueError, match="speculative_draft_vocab_size is only used by speculative_method"):
        LLM(model=target, speculative_method="ngram", speculative_draft_vocab_size=100)
    with pytest.raises(ValueError, match="speculative_draft_vocab_size must be an integer >= 1, got 0"):
        LLM(model=target, speculative_model=target, speculative_draft_vocab_size=0)
    with pytest.raises(ValueError, match="speculative_draft_vocab_corpus needs speculative_draft_vocab_size"):
        LLM(model=target, speculative_model=target, speculative_draft_vocab_corpus=str(tmp_path))
    with pytest.raises(ValueError, match="speculative_draft_vocab_corpus path '/nonexistent' does not exist"):
        LLM(model=target, speculative_model=target, speculative_draft_vocab_size=10,
            speculative_draft_vocab_corpus="/nonexistent")
    # a corpus with nothing to count: refused by the options themselves, before either model loads
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\x00")
    for corpus, message in ((tmp_path / "empty.txt", "holds only empty files"), (tmp_path / "binary", "holds no")):
        with pytest.raises(ValueError, match=f"speculative_draft_vocab_corpus .*{message}"):
            EngineArgs(model=target, speculative_model=target, speculative_draft_vocab_size=10,
                       speculative_draft_vocab_corpus=str(corpus)).speculative_config()


def test_a_corrupt_cache_is_counted_again_and_odd_file_names_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  hf_tokenizer) -> None:
    """Fresh-user trial: a cache cut short, empty or overwritten failed every later run; a file name that is not
    UTF-8 failed the cache key."""
    import loom.spec.draft_vocab as dv

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha beta gamma\n" * 10)
    (corpus / os.fsdecode(b"b\xff.txt")).write_text("delta\n")
    vocab = len(hf_tokenizer)
    expected = token_counts(hf_tokenizer, vocab, str(corpus))
    (cache,) = (tmp_path / "cache" / "draft_vocab").glob("*.npy")
    good = cache.read_bytes()
    for bad in (b"", good[: len(good) // 3], b"garbage" * 100):
        cache.write_bytes(bad)
        assert np.array_equal(token_counts(hf_tokenizer, vocab, str(corpus)), expected)
        assert cache.read_bytes() == good  # rewritten whole
    assert not list(cache.parent.glob("*.tmp"))
    # long files are read in pieces and a corpus is counted up to a bound
    (corpus / "a.txt").write_text("alpha beta gamma\n" * 1000)
    whole = token_counts(hf_tokenizer, vocab, str(corpus))
    monkeypatch.setattr(dv, "PIECE_CHARS", 100)
    (corpus / "a.txt").write_text("alpha beta gamma\n" * 1000 + "\n")  # new size: not from the cache
    pieces = token_counts(hf_tokenizer, vocab, str(corpus))
    # tokens differ only where a piece ends (after a line: at most a few per cut, 171 cuts)
    assert np.abs(pieces - whole).sum() <= 4 * 171 and abs(int(pieces.sum()) - int(whole.sum())) < 0.05 * whole.sum()
    monkeypatch.setattr(dv, "MAX_CORPUS_CHARS", 170)
    (corpus / "a.txt").write_text("alpha beta gamma\n" * 1000)
    assert 0 < token_counts(hf_tokenizer, vocab, str(corpus)).sum() < whole.sum() / 50


def test_a_bad_corpus_fails_before_the_draft_loads(tiny_dirs: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import loom.spec.proposer as proposer

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "blank.txt").write_text("")
    context = _context(tiny_dirs)
    monkeypatch.setattr("loom.worker.model_runner.ModelRunner.__init__",
                        lambda *a, **k: pytest.fail("the draft loaded before its corpus was checked"))
    target = str(tiny_dirs["target"])
    with pytest.raises(ValueError, match="holds only empty files"):  # refused by the options themselves now
        proposer._draft_model(proposer.SpeculativeConfig(method="draft_model", model=target, draft_vocab_size=10,
                                                         draft_vocab_corpus=str(tmp_path / "blank.txt")),
                              context)


def _context(tiny_dirs: dict[str, Path]):
    llm = LLM(model=str(tiny_dirs["target"]), dtype="float32")
    runner = llm.engine.runner
    from loom.spec.proposer import ProposerContext

    return ProposerContext(dtype="float32", quantization=None, seed=0, block_size=4, kv_cache_memory_bytes=1 << 20,
                           device=torch.device("cpu"), max_model_len=512, vocab_size=runner.arch.vocab_size,
                           tokenizer=runner.tokenizer)


@pytest.mark.parametrize("value", ["4096", 4096.0, True, -1])
def test_the_size_must_be_an_integer(tiny_dirs: dict[str, Path], value) -> None:
    with pytest.raises(ValueError, match="speculative_draft_vocab_size must be an integer >= 1"):
        LLM(model=str(tiny_dirs["target"]), speculative_model=str(tiny_dirs["target"]),
            speculative_draft_vocab_size=value)


def test_an_fp8_lm_head_is_restricted_on_its_e4m3_rows(tiny_dirs: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 LM head (a compressed-tensors checkpoint whose lm_head has a weight_scale; loom's own fp8 keeps the
    head at w8a16, LM_HEAD_SCHEME) keeps its e4m3 rows and scales on the CPU: restricting it slices both."""
    from loom.quant import config
    from loom.quant.methods import Fp8LinearMethod

    monkeypatch.setattr(config, "LM_HEAD_SCHEME", {})
    runner = _runner(tiny_dirs["target"], "fp8")
    m = runner.model
    assert isinstance(m.lm_head.quant_method, Fp8LinearMethod)
    hidden = torch.randn(3, runner.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    full = m.compute_logits(hidden)
    ids = torch.tensor([0, 5, 77, 1000, runner.arch.vocab_size - 1])
    restrict_lm_head(m, ids)
    got = m.compute_logits(hidden)
    torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-6, atol=1e-6)
