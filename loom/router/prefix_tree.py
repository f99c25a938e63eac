"""An approximate record of the prompts a replica has seen: a radix tree over characters, LRU-bounded.

The router cannot see a replica's KV cache; it remembers the text it sent there instead (SGLang's router does
the same, "approximate tree"), and reads the longest remembered prefix of a new prompt as the part the
replica's prefix cache probably holds. Approximate because the replica evicts on its own and caches whole
token blocks; it is only a ranking signal. Characters, not tokens, so the router needs no tokenizer.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    edge: str  # the characters on the edge from the parent to this node ("" for the root)
    parent: "_Node | None"
    children: dict[str, "_Node"] = field(default_factory=dict)  # first character of the child's edge -> child
    last_access: float = 0.0  # router clock of the newest insert or match through this node


def _common_prefix(a: str, b: str, start_b: int) -> int:
    """Length of the common prefix of a and b[start_b:] (string comparisons at C speed: a whole-edge match is
    one startswith, a partial one a binary search over slice equality)."""
    if b.startswith(a, start_b):
        return len(a)
    lo, hi = 0, min(len(a), len(b) - start_b)  # a[:lo] matches; a[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid], start_b):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Radix tree of the texts routed to one replica, holding at most `max_chars` characters.

    `insert` and `match` are O(length of the text); eviction removes least recently used leaves.
    """

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.num_chars = 0  # characters stored on all edges
        self._root = _Node("", None)

    def match(self, text: str, now: float | None = None) -> int:
        """Characters of the longest prefix of `text` in the tree; marks the path used when `now` is given."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_prefix(child.edge, text, i)
            if now is not None:
                child.last_access = now
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, text: str, now: float) -> None:
        """Remember `text` (split edges where it diverges), then evict down to the bound."""
        node, i = self._root, 0
        node.last_access = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, last_access=now)
                node.children[text[i]] = leaf
                self.num_chars += len(leaf.edge)
                break
            k = _common_prefix(child.edge, text, i)
            if k < len(child.edge):  # diverges inside the edge: split it at k
                mid = _Node(child.edge[:k], node, last_access=now)
                node.children[text[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_access = now
            i += k
            node = child
        if self.num_chars > self.max_chars:
            self._evict(self.max_chars * 9 // 10)

    def _evict(self, target_chars: int) -> None:
        """Drop least recently used leaves until at most `target_chars` remain."""
        heap: list[tuple[float, int, _Node]] = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self._root:
                heap.append((n.last_access, id(n), n))
            stack.extend(n.children.values())
        heapq.heapify(heap)
        while heap and self.num_chars > target_chars:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.num_chars -= len(leaf.edge)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))


__all__ = ["PrefixTree"]
