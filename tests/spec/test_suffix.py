"""The suffix proposer (SuffixDecoding): its trees against brute-force counts, the draft rule, the global
cache of earlier outputs, and the per-request state."""

from __future__ import annotations

import random

import pytest

from loom.engine.arg_utils import add_engine_args, engine_args_from_namespace
from loom.spec import SpeculativeConfig, make_proposer
from loom.spec.suffix import SuffixProposer, SuffixTree


def _brute(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int]]:
    """substring -> (occurrences, occurrences followed by one more token within the depth)."""
    stats: dict[tuple[int, ...], list[int]] = {}
    for seq in seqs:
        for p in range(len(seq)):
            for n in range(1, depth + 1):
                if p + n > len(seq):
                    break
                entry = stats.setdefault(tuple(seq[p : p + n]), [0, 0])
                entry[0] += 1
                if n < depth and p + n < len(seq):
                    entry[1] += 1
    return {k: (v[0], v[1]) for k, v in stats.items()}


def _tree_stats(tree: SuffixTree, strings) -> dict[tuple[int, ...], tuple[int, int]]:
    out = {}
    for s in strings:
        node = tree.find(s)
        assert node >= 0, s
        out[s] = (tree._count[node], tree._total[node])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_tree_counts_every_substring_up_to_its_depth(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5])
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    expected = _brute(seqs, depth)
    tree = SuffixTree(depth)
    for seq in seqs:
        tree.add(seq)
    assert _tree_stats(tree, expected) == expected
    assert tree.num_nodes == len(expected) + 1  # the root and one node per distinct substring
    assert tree.find([9]) == -1 and tree.find(list(seqs[0][:depth]) + [9]) == -1

    grown = SuffixTree(depth)  # the same sequences token by token, as a request's tree grows
    for seq in seqs:
        active: list[int] = []
        for token in seq:
            active = grown.append(active, token)
        assert [grown.find(seq[len(seq) - j - 1 :]) for j in range(len(active))] == active
    assert _tree_stats(grown, expected) == expected


@pytest.mark.parametrize("seed", range(3))
def test_longest_suffix_matches_brute_force(seed: int) -> None:
    rng = random.Random(10 + seed)
    seq = [rng.randrange(3) for _ in range(40)]
    tree = SuffixTree(6)
    tree.add(seq)
    present = _brute([seq], 6)
    for _ in range(50):
        query = [rng.randrange(4) for _ in range(rng.randrange(0, 9))]
        want = max((n for n in range(0, min(6, len(query)) + 1) if n == 0 or tuple(query[-n:]) in present))
        assert tree.longest_suffix(query) == want, query


def test_draft_follows_the_most_frequent_continuation_and_stops_below_min_prob() -> None:
    tree = SuffixTree(8)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [7, 7]):
        tree.add(seq)
    node = tree.find([1, 2])
    assert tree.draft(node, 5, 0.1) == ([3, 4], pytest.approx(2 / 3 + 2 / 3))
    assert tree.draft(node, 1, 0.1)[0] == [3]
    assert tree.draft(node, 5, 0.7) == ([], 0.0)  # 2 of 3 continuations: below 0.7
    assert tree.draft(tree.find([7, 7]), 5, 0.0) == ([], 0.0)  # no occurrence continues
    ties = SuffixTree(4)
    ties.add([1, 8, 1, 9])  # 8 and 9 follow 1 once each: the first to get there wins
    assert ties.draft(ties.find([1]), 1, 0.1)[0] == [8]


def test_request_tree_drafts_from_its_prompt_and_grows_with_its_output() -> None:
    p = SuffixProposer(max_tree_depth=16, max_cached_requests=0)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11]
    assert p.propose("r", prompt, 8) == [12, 13]  # match of 2 tokens: at most 2 drafts (max_spec_factor 1)
    assert p.propose("r", prompt + [12, 13, 14], 8) == [15, 16, 17, 99, 10]  # match of 5: 5 drafts
    assert p.propose("r", prompt + [12, 13, 14], 3) == [15, 16, 17]
    assert p.propose("r", prompt + [12, 13, 14], 0) == []
    assert p.propose("q", [1, 2, 3], 4) == []  # nothing repeats
    p.request_finished("r", [12, 13, 14])
    p.request_finished("q", [])
    p.request_finished("never-seen", [5])
    assert p._requests == {}  # state freed on every end
    assert p.num_cached_requests == 0  # the global tree is off


def test_incremental_state_drafts_what_a_fresh_proposer_drafts() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(30)]
    kept = SuffixProposer(max_tree_depth=6, max_cached_requests=0, min_token_prob=0.0)
    for n in range(1, len(tokens)):
        fresh = SuffixProposer(max_tree_depth=6, max_cached_requests=0, min_token_prob=0.0)
        assert kept.propose("r", tokens[:n], 4) == fresh.propose("r", tokens[:n], 4), n


def test_global_tree_drafts_from_earlier_outputs_and_keeps_the_newest() -> None:
    p = SuffixProposer(max_tree_depth=12, max_cached_requests=4)
    answer = [40, 41, 42, 43, 44, 45]
    p.request_finished("a", answer)
    assert p.propose("b", [7, 8, 40, 41, 42], 8) == [43, 44, 45]  # from a's output, not b's prompt
    for i in range(4):  # generations of 2: [a, x0] [x1, x2], then x3 drops the first
        p.request_finished(f"x{i}", [100 + i, 200 + i])
    assert p.num_cached_requests == 3
    assert p.propose("c", [7, 8, 40, 41, 42], 8) == []
    assert p.propose("d", [9, 103], 4) == [203]


def test_the_better_scored_tree_wins() -> None:
    p = SuffixProposer(max_tree_depth=12, max_cached_requests=8)
    p.request_finished("o", [5, 6, 1, 2, 3, 4, 7, 8, 10])
    # locally 1 2 3 matches (3 tokens: 3 drafts, 9 5 6); globally 5 6 1 2 3 (5 tokens: 4 drafts)
    assert p.propose("r", [1, 2, 3, 9, 5, 6, 1, 2, 3], 4) == [4, 7, 8, 10]
    p2 = SuffixProposer(max_tree_depth=12, max_cached_requests=8)
    p2.request_finished("o", [6, 1, 2, 3, 4, 5])
    assert p2.propose("r", [5, 6, 1, 2, 3, 9, 8, 5, 6, 1, 2, 3], 3) == [9, 8, 5]  # longer local match


def test_branches_are_the_other_trees_drafts_best_first() -> None:
    p = SuffixProposer(max_tree_depth=12, max_cached_requests=8)
    p.request_finished("o", [5, 6, 1, 2, 3, 4, 7, 8, 10])
    tokens = [1, 2, 3, 9, 5, 6, 1, 2, 3]
    # the global tree's draft scores higher (branch 0, what propose gives), the request's own is branch 1
    assert p.propose_candidates("r", tokens, 4, 3) == [[4, 7, 8, 10], [9, 5, 6]]
    assert p.propose_candidates("r", tokens, 4, 1) == [p.propose("r", tokens, 4)]
    p.request_finished("o2", [1, 2, 3, 4, 0])  # another draft starting with 4: not a branch of its own
    assert [b[0] for b in p.propose_candidates("r", tokens, 4, 3)] == [4, 9]


def test_options_are_checked_and_reach_the_proposer() -> None:
    for bad, name in ((dict(suffix_max_tree_depth=1), "max_tree_depth"),
                      (dict(suffix_max_cached_requests=-1), "max_cached_requests"),
                      (dict(suffix_max_spec_factor=0.0), "max_spec_factor"),
                      (dict(suffix_max_spec_offset=-1.0), "max_spec_offset"),
                      (dict(suffix_min_token_prob=1.5), "min_token_prob")):
        with pytest.raises(ValueError, match=f"suffix_decoding_{name}"):
            SpeculativeConfig(method="suffix", **bad)
    import argparse

    ns = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--speculative-method", "suffix", "--suffix-decoding-max-tree-depth", "9",
         "--suffix-decoding-max-cached-requests", "0", "--suffix-decoding-min-token-prob", "0.3"])
    proposer = make_proposer(engine_args_from_namespace(ns).speculative_config())
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.max_tree_depth, proposer.max_cached_requests, proposer.min_token_prob) == (9, 0, 0.3)
