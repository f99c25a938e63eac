"""The proposer seam and the n-gram (prompt lookup) proposer."""

from __future__ import annotations

import pytest

from loom.spec import NgramProposer, SpeculativeConfig, make_proposer
from loom.spec.proposer import DraftRequest


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 4, 5, 6, 7]
    # the suffix [5, 6, 7] occurs at 0 (then 8 9 1) and at 6 (then 4 5 6): the most recent wins
    assert p.propose("r", tokens, 3) == [4, 5, 6]
    assert p.propose("r", tokens, 1) == [4]
    assert p.propose("r", tokens, 0) == []


def test_ngram_falls_back_to_shorter_suffixes_and_gives_up() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose("r", [1, 2, 3, 9, 2, 3], 2) == [9, 2]  # [2, 3] matches at 1
    assert p.propose("r", [1, 2, 3, 4, 5, 3], 2) == [4, 5]  # only [3] matches
    assert NgramProposer(2, 3).propose("r", [1, 2, 3, 4, 5, 3], 2) == []  # [3] is shorter than min_n
    assert p.propose("r", [7], 4) == []
    assert p.propose("r", [], 4) == []


def test_ngram_continuation_stops_at_the_end_of_the_tokens() -> None:
    p = NgramProposer(min_n=2, max_n=2)
    assert p.propose("r", [3, 3, 3, 3], 5) == [3]  # the match at 1..2 is followed by the last token only


def test_ngram_branches_follow_other_matches_with_other_first_drafts() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 8, 2, 5, 6, 7, 4, 6, 7]
    # [6, 7] matches at 1, 6 and 11 (then 8 9, 8 2, 4 6): most recent first, a repeated first draft
    # skipped; then the shorter suffix [7] adds nothing new (its matches are followed by 8, 8, 4 too)
    assert p.propose_candidates("r", tokens, 2, 3) == [[4, 6], [8, 2]]
    assert p.propose_candidates("r", tokens, 2, 1) == [p.propose("r", tokens, 2)] == [[4, 6]]
    assert p.propose_branches([DraftRequest("r", tokens, 2)], 2) == [[[4, 6], [8, 2]]]
    assert p.propose_candidates("r", [1, 2, 3], 2, 3) == []
    # branches from a shorter suffix: [9, 7] matches nowhere, [7] at 1 (then 3) and at 3 (then 9)
    assert NgramProposer(1, 2).propose_candidates("r", [1, 7, 3, 7, 9, 7], 1, 4) == [[9], [3]]


def test_config_validation_names_the_option() -> None:
    with pytest.raises(ValueError, match="speculative_method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    for width in (0, 9):
        with pytest.raises(ValueError, match="speculative_tree_width"):
            SpeculativeConfig(tree_width=width)
    with pytest.raises(ValueError, match="speculative_tree_width"):
        SpeculativeConfig(method="draft_model", model=__file__, tree_width=2)
    assert make_proposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=5)).propose("r", [1, 2, 1], 2) == [2, 1]


def test_engine_args_check_the_speculative_options_even_when_off() -> None:
    from loom.config import EngineArgs

    # a draft model alone turns draft-model speculation on (it used to be ignored: no speculation at all)
    assert EngineArgs(speculative_model=__file__).speculative_config().method == "draft_model"
    assert EngineArgs().speculative_config() is None

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(num_speculative_tokens=99)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineArgs(prompt_lookup_min=9, prompt_lookup_max=1)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineArgs(speculative_disable_by_batch_size=0)
    assert EngineArgs().speculative_config() is None
    assert EngineArgs(speculative_method="ngram").speculative_config() == SpeculativeConfig()
    assert EngineArgs(speculative_method="ngram", speculative_disable_by_batch_size=None).speculative_config() \
        == SpeculativeConfig(disable_by_batch_size=None)


def test_speculative_options_without_a_method_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    from loom.config import EngineArgs

    with caplog.at_level("WARNING", logger="loom.config"):
        EngineArgs(speculative_tree_width=2, num_speculative_tokens=6)
    assert "speculative_tree_width" in caplog.text and "num_speculative_tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="loom.config"):
        EngineArgs(speculative_method="ngram", speculative_tree_width=2)
        EngineArgs()
    assert caplog.text == ""


def test_disable_by_batch_size_flag_takes_an_int_or_none() -> None:
    import argparse

    from loom.engine.arg_utils import add_engine_args, engine_args_from_namespace

    parser = add_engine_args(argparse.ArgumentParser())
    for text, want in (("5", 5), ("none", None), ("None", None)):
        args = engine_args_from_namespace(parser.parse_args(["--speculative-disable-by-batch-size", text]))
        assert args.speculative_disable_by_batch_size == want
    assert engine_args_from_namespace(parser.parse_args([])).speculative_disable_by_batch_size == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-disable-by-batch-size", "many"])


def test_options_without_speculation_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    """The CLI and LLM() each build EngineArgs from the same flags: the warning about speculative options that do
    nothing while speculation is off is given once, and draft-model options warn too instead of being refused as
    ngram's (a fresh-user trial saw "... got method 'ngram'" for --speculative-draft-vocab-size alone)."""
    import logging

    from loom.config import EngineArgs

    with caplog.at_level(logging.WARNING, logger="loom.config"):
        for _ in range(2):
            EngineArgs(num_speculative_tokens=13, speculative_draft_vocab_size=777, speculative_quantization="w4a16")
    warned = [r.getMessage() for r in caplog.records if "no effect without speculative_method" in r.getMessage()]
    assert warned == ["num_speculative_tokens, speculative_quantization, speculative_draft_vocab_size: no effect "
                      "without speculative_method (speculation is off)"]
