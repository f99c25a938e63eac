"""The router's approximate prefix tree: longest-prefix match, edge splits and LRU eviction."""

from __future__ import annotations

import random

import pytest

from loom.router.prefix_tree import PrefixTree


def _reference_match(texts: list[str], query: str) -> int:
    best = 0
    for t in texts:
        n = 0
        while n < min(len(t), len(query)) and t[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


def test_match_is_the_longest_common_prefix_with_any_inserted_text() -> None:
    rng = random.Random(0)
    tree = PrefixTree(max_chars=1 << 20)
    texts: list[str] = []
    for i in range(300):  # a small alphabet makes many shared prefixes and edge splits
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        tree.insert(text, now=float(i))
        texts.append(text)
        query = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        assert tree.match(query) == _reference_match(texts, query)
    assert tree.num_chars <= sum(len(t) for t in texts)


def test_shared_prefixes_are_stored_once() -> None:
    tree = PrefixTree(max_chars=1000)
    system = "You are a helpful assistant. " * 4
    tree.insert(system + "What is 2+2?", 0.0)
    tree.insert(system + "Name a colour.", 1.0)
    assert tree.num_chars == len(system) + len("What is 2+2?") + len("Name a colour.")
    assert tree.match(system + "Tell me a joke") == len(system)


def test_eviction_drops_least_recently_used_texts_first() -> None:
    tree = PrefixTree(max_chars=100)
    tree.insert("a" * 40, 0.0)
    tree.insert("b" * 40, 1.0)
    tree.match("a" * 40, now=2.0)  # "a..." is now the more recently used
    tree.insert("c" * 40, 3.0)  # 120 > 100: evict down to 90, the oldest first ("b...")
    assert tree.num_chars <= 100
    assert tree.match("a" * 40) == 40 and tree.match("c" * 40) == 40
    assert tree.match("b" * 40) == 0


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)
