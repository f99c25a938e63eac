"""The suffix proposer: SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications", arXiv:2411.04975; vLLM's `suffix` method).

Two depth-limited suffix trees count every substring of up to `max_tree_depth` tokens:

- one per request, over its prompt and its output so far, grown by the tokens appended since the last step;
- one global tree over the outputs of the last `max_cached_requests` finished requests, so a workload that
  repeats itself (agents, retries, templated answers) drafts from what the model wrote before.

Each step matches the longest suffix of the request's tokens that occurred earlier with a continuation, then
walks down the tree taking the most frequent child while the product of the children's frequencies (an
estimate of the probability that the whole draft is kept) stays at or above `min_token_prob`. The number of
drafts grows with the match: at most `max_spec_factor * match_length + max_spec_offset`, so a long verbatim
match drafts the full k and a one-token match drafts one. Of the per-request and the global tree, the draft
with the higher score (the sum of its tokens' estimated probabilities, the expected number kept) is used.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from loom.spec.proposer import PerRequestProposer, check_suffix_options

_TOKEN_BITS = 32  # a child is keyed by (node << 32) | token: token ids are below 2**32


class SuffixTree:
    """Occurrence counts of every substring of length <= max_depth of the sequences added to it.

    This is the trie of all suffixes cut at max_depth, which is what SuffixDecoding's trees hold. Nodes are
    ints (0 is the root, the empty string); about 120 bytes each, at most max_depth new nodes per token added.
    Per node it keeps the number of occurrences that continue (`total`) and the child with the most of them
    (`best`, the earliest to reach a count winning ties), so a draft costs one lookup per token.
    """

    __slots__ = ("max_depth", "_child", "_count", "_total", "_best", "_best_token")

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._child: dict[int, int] = {}  # (node << 32) | token -> child node
        self._count = array("q", [0])  # occurrences of the node's string
        self._total = array("q", [0])  # occurrences followed by a further token (sum of the children's counts)
        self._best = array("q", [-1])  # the child with the most occurrences, -1 for none
        self._best_token = array("q", [0])  # the token leading to it

    @property
    def num_nodes(self) -> int:
        return len(self._count)

    def extend(self, node: int, token: int) -> int:
        """Count one more occurrence of node's string followed by `token`; return that child."""
        key = (node << _TOKEN_BITS) | token
        child = self._child.get(key)
        if child is None:
            child = len(self._count)
            self._child[key] = child
            self._count.append(0)
            self._total.append(0)
            self._best.append(-1)
            self._best_token.append(0)
        count = self._count[child] + 1
        self._count[child] = count
        self._total[node] += 1
        best = self._best[node]
        if best < 0 or (best != child and count > self._count[best]):
            self._best[node] = child
            self._best_token[node] = token
        return child

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of `tokens` up to max_depth long."""
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.max_depth]:
                node = self.extend(node, token)

    def append(self, active: list[int], token: int) -> list[int]:
        """Grow a sequence already in the tree by one token.

        active: the nodes of the sequence's suffixes, shortest first (active[j] is the suffix of length j + 1);
        returns the new list, which the caller keeps for the next token.
        """
        extend = self.extend
        grown = [extend(0, token)]
        grown.extend([extend(node, token) for node in active[: self.max_depth - 1]])
        return grown

    def find(self, tokens: Sequence[int]) -> int:
        """The node of `tokens` (at most max_depth long), or -1 if it never occurred."""
        node = 0
        for token in tokens:
            node = self._child.get((node << _TOKEN_BITS) | token, -1)
            if node < 0:
                return -1
        return node

    def longest_suffix(self, tokens: Sequence[int]) -> int:
        """The length of the longest suffix of `tokens` (at most max_depth) that occurs in the tree.

        Every substring of an occurring string occurs too, so the suffixes that occur are exactly those up to
        some length, which a binary search finds.
        """
        lo, hi = 0, min(self.max_depth, len(tokens))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.find(tokens[len(tokens) - mid :]) >= 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def continues(self, node: int) -> bool:
        return self._total[node] > 0

    def draft(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child from `node` while the running product of the children's
        frequencies stays >= min_prob; return the tokens and their summed probabilities (the expected number
        of them a verifier keeps, if the counts are the model's distribution)."""
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < max_tokens:
            total = self._total[node]
            if total == 0:
                break
            child = self._best[node]
            prob *= self._count[child] / total
            if prob < min_prob:
                break
            tokens.append(self._best_token[node])
            score += prob
            node = child
        return tokens, score


class _RequestTree:
    __slots__ = ("tree", "active", "num_tokens")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.active: list[int] = []  # nodes of the request's suffixes, shortest first
        self.num_tokens = 0  # tokens of the request added so far


class SuffixProposer(PerRequestProposer):
    """SuffixDecoding's proposer over a per-request and a global suffix tree (module docstring).

    State: one tree per request it drafted for (freed by `request_finished`) and the global tree, kept as
    two generations of up to max_cached_requests / 2 outputs each: outputs go into the newer, and when it is
    full the older generation is dropped whole and a new one started, so the cache holds between
    max_cached_requests / 2 and max_cached_requests of the newest outputs and no eviction ever rebuilds or
    walks a tree (a finished request costs one insertion, ~6 ms for 256 tokens at depth 24). A draft is
    taken from each generation; the best scored wins. max_cached_requests = 0 turns the global tree off.
    """

    name = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 128, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1) -> None:
        check_suffix_options(max_tree_depth, max_cached_requests, max_spec_factor, max_spec_offset, min_token_prob)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestTree] = {}
        self._generation_size = max(1, max_cached_requests // 2)
        # the global tree's generations, oldest first, each with the number of outputs it holds
        self._generations: deque[tuple[SuffixTree, list[int]]] = deque()

    @property
    def num_cached_requests(self) -> int:
        return sum(count[0] for _, count in self._generations)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        candidates = self.propose_candidates(request_id, token_ids, max_tokens, 1)
        return candidates[0] if candidates else []

    def propose_candidates(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                           max_branches: int) -> list[list[int]]:
        """The drafts of every source (the per-request tree and each generation of the global one, at the
        match length and at the roomy shorter one), best scored first; a draft whose first token an
        earlier one already has is skipped, so branches differ from their first draft on."""
        if max_tokens <= 0 or not token_ids:
            return []
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestTree(self.max_tree_depth)
        tree = state.tree
        for token in token_ids[state.num_tokens :]:
            state.active = tree.append(state.active, token)
        state.num_tokens = len(token_ids)

        found: list[tuple[list[int], float]] = []
        # the per-request tree: the longest suffix that occurred before with a continuation (the suffix
        # itself, at the end, never continues)
        for length in range(len(state.active), 0, -1):
            if tree.continues(state.active[length - 1]):
                self._drafts(tree, length, lambda n: state.active[n - 1], max_tokens, found)
                break
        for cache, _ in self._generations:
            length = cache.longest_suffix(token_ids)
            tail = token_ids[len(token_ids) - length :]
            while length > 0 and not cache.continues(cache.find(tail[len(tail) - length :])):
                length -= 1
            if length > 0:
                self._drafts(cache, length, lambda n, c=cache, t=tail: c.find(t[len(t) - n :]), max_tokens, found)
        found.sort(key=lambda d: -d[1])  # stable: of equal scores the first found leads
        branches: list[list[int]] = []
        for tokens, score in found:
            if score > 0 and all(tokens[0] != b[0] for b in branches):
                branches.append(tokens)
                if len(branches) == max_branches:
                    break
        return branches

    def _drafts(self, tree: SuffixTree, length: int, node_of, max_tokens: int,
                found: list[tuple[list[int], float]]) -> None:
        """Append to `found` the drafts from the suffix of `length` tokens and, if the tree's depth leaves
        that one too little room below it, from the longest shorter suffix that leaves room."""
        lengths = [length]
        roomy = self.max_tree_depth - max_tokens
        if 0 < roomy < length:
            lengths.append(roomy)
        for n in lengths:
            node = node_of(n)
            if node < 0:
                continue
            limit = min(max_tokens, int(self.max_spec_factor * n + self.max_spec_offset))
            found.append(tree.draft(node, limit, self.min_token_prob))

    def request_finished(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        if not self._generations or self._generations[-1][1][0] >= self._generation_size:
            if len(self._generations) == 2:
                self._generations.popleft()
            self._generations.append((SuffixTree(self.max_tree_depth), [0]))
        tree, count = self._generations[-1]
        tree.add(output_token_ids)
        count[0] += 1
