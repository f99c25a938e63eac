"""Context parallelism for the prefill of one long prompt: ring attention (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", arXiv:2310.01889).

The prompt's tokens are split over the ranks of a group; each rank holds the queries, keys and values of its own
positions (its q/k/v projections need nothing from the others). Attention needs every key, so the K/V chunks travel
round a ring: at each of `size` steps a rank attends its queries to the chunk it holds, while it already sends that
chunk to rank + 1 and receives the next from rank - 1, so the transfer hides behind the compute. After `size` steps
each query has met every key, and each rank's output rows are exact attention over the whole prompt.

The partial results of the blocks merge with the online-softmax rule (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax", arXiv:1805.02867; FlashAttention, Dao et al. 2022, arXiv:2205.14135): per
query row a running maximum m, a running sum l of exp(s - m) and an unnormalized output o; a block with maximum m'
rescales both sides to max(m, m') before adding. The result is exact up to float rounding: no approximation.

Communication per rank: (size - 1) sends of one K/V chunk, i.e. (size - 1) x 2 x n_max x num_kv_heads x head_dim x
itemsize bytes, plus one all-gather of the chunk lengths (and of the positions, where a split is not contiguous).

Causal masking is by global position. With the contiguous split rank r's queries see the chunks of ranks 0..r and
skip the rest, so the last rank does `size` blocks of work and rank 0 one: the ring runs at the pace of the last
rank. The zigzag split (`split_sequence_zigzag`) cuts the prompt into 2 x size chunks and gives rank r chunks r and
2 x size - 1 - r, an early and a late one, so every rank attends about the same number of (query, key) pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loom.distributed.tensor_parallel import partition


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """This process's place in a context-parallel group (ring order = rank order)."""

    rank: int  # 0 .. size - 1 within the group
    size: int  # ranks in the ring (1 = everything local, no communication)
    group: Any = None  # torch.distributed ProcessGroup of the ranks; None = the default group

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context parallel rank {self.rank} of size {self.size}: need size >= 1, "
                             "0 <= rank < size")


def split_sequence(n: int, cp: ContextParallel) -> torch.Tensor:
    """Global positions [n_local] int64 of this rank's contiguous share of n tokens (the first n % size ranks one
    more). Causal attention over this split leaves the last rank the most work (see the module docstring).

    Raises:
        ValueError: n < 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    start, stop = partition(n, cp.size, cp.rank)
    return torch.arange(start, stop, dtype=torch.int64)


def split_sequence_zigzag(n: int, cp: ContextParallel) -> torch.Tensor:
    """Global positions [n_local] int64, ascending, of this rank's zigzag share of n tokens: of 2 x size contiguous
    chunks (the first n % (2 x size) one larger), chunks rank and 2 x size - 1 - rank. Under causal attention every
    rank then computes about the same number of (query, key) pairs.

    Raises:
        ValueError: n < 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    chunks = 2 * cp.size
    early = partition(n, chunks, cp.rank)
    late = partition(n, chunks, chunks - 1 - cp.rank)
    return torch.cat([torch.arange(*early, dtype=torch.int64), torch.arange(*late, dtype=torch.int64)])


@dataclass(slots=True)
class SoftmaxPartial:
    """Attention of some query rows over a subset of the keys, before normalization (online softmax state).

    The leading dimensions [...] are any batch of heads, e.g. [num_kv_heads, group, ...]; all float32.
    """

    out: torch.Tensor  # [..., n, head_dim]: sum over the keys seen of exp(s - row_max) * v
    row_max: torch.Tensor  # [..., n]: largest score seen; -inf where no key was visible yet
    row_sum: torch.Tensor  # [..., n]: sum over the keys seen of exp(s - row_max)


def empty_partial(batch: tuple[int, ...], n: int, head_dim: int, device: torch.device | str = "cpu"
                  ) -> SoftmaxPartial:
    """The state of n rows that have seen no key: out 0, row_max -inf, row_sum 0 (float32)."""
    return SoftmaxPartial(torch.zeros(*batch, n, head_dim, device=device),
                          torch.full((*batch, n), -math.inf, device=device),
                          torch.zeros(*batch, n, device=device))


def block_partial(scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> SoftmaxPartial:
    """The softmax state of one block of keys.

    Args:
        scores: [..., n, m] float32, already scaled.
        v: [..., m, head_dim] float32 (broadcast against scores' leading dimensions).
        mask: [n, m] bool, True where a key is visible, or None for all visible.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(dim=-1)
    p = torch.exp(scores - _finite_or_zero(row_max).unsqueeze(-1))  # exp(-inf) = 0 for masked keys
    return SoftmaxPartial(p @ v, row_max, p.sum(dim=-1))


def merge_partials(a: SoftmaxPartial, b: SoftmaxPartial) -> SoftmaxPartial:
    """The state of the union of two disjoint key sets: both sides rescaled to the larger running maximum
    (Milakov & Gimelshein 2018, arXiv:1805.02867). Rows that saw no key on either side stay empty (no NaN)."""
    row_max = torch.maximum(a.row_max, b.row_max)
    ref = _finite_or_zero(row_max)
    scale_a, scale_b = torch.exp(a.row_max - ref), torch.exp(b.row_max - ref)
    return SoftmaxPartial(a.out * scale_a.unsqueeze(-1) + b.out * scale_b.unsqueeze(-1), row_max,
                          a.row_sum * scale_a + b.row_sum * scale_b)


def finish_partial(p: SoftmaxPartial) -> torch.Tensor:
    """Normalized attention output [..., n, head_dim] float32; rows that saw no visible key come out 0."""
    return p.out / torch.where(p.row_sum > 0, p.row_sum, 1.0).unsqueeze(-1)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, *, scale: float,
                   causal: bool = True, sliding_window: int | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's query rows over the keys of every rank in the ring (Liu et al. 2023,
    arXiv:2310.01889), merged blockwise with the online softmax. Every rank of `cp.group` must call it together.

    Args:
        q: [n_local, num_heads, head_dim] float32, bfloat16 or float16: this rank's queries.
        k: [n_local, num_kv_heads, head_dim], same dtype: this rank's keys; num_heads a multiple of num_kv_heads
            (query head h reads KV head h // (num_heads // num_kv_heads)).
        v: like k: this rank's values.
        cp: the ring. n_local may differ between ranks (even be 0); the circulated chunks are padded to the
            longest and trimmed to the true length on arrival.
        scale: score multiplier, usually head_dim ** -0.5.
        causal: a query at position i sees keys at positions <= i; False: every key.
        sliding_window: with causal, a query at i sees only keys at j > i - sliding_window (itself included);
            None = unlimited.
        positions: [n_local] integer global positions of this rank's rows (e.g. `split_sequence_zigzag`); None = the
            contiguous split in rank order (rank r's rows follow rank r - 1's).

    Returns:
        [n_local, num_heads, head_dim] in q's dtype (scores, softmax and sums in float32).

    Raises:
        ValueError: bad shapes or dtypes (naming q, k, v or positions), scale not positive, sliding_window < 1 or
            without causal, ranks disagreeing on heads / head_dim, or positions repeated across the ranks. Raised on
            every rank when any rank's inputs are bad (one all-gather of the shapes comes first), so none hangs.

    Causal keys wholly in a query tile's future (the later ranks' chunks under the contiguous split) are skipped,
    not masked, and only the diagonal strip of a chunk is masked; the chunks are still forwarded round the ring.
    """
    try:
        _check_local(q, k, v, scale, causal, sliding_window, positions)
        local_error = None
    except ValueError as e:
        local_error = e
    lengths, all_positions = _gather_layout(q, k, cp, positions, local_error)
    n_local, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    n_max = max(lengths)
    if n_max == 0:
        return torch.empty_like(q)
    group = num_heads // num_kv_heads
    # [num_kv_heads, group, n_local, head_dim]: query head kv * group + g reads KV head kv
    q32 = (q.float() * scale).reshape(n_local, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).contiguous()
    q_pos = all_positions[cp.rank]
    q_tiles = [(a, min(a + _Q_TILE, stop)) for start, stop in _runs(q_pos) for a in range(start, stop, _Q_TILE)]
    states = [empty_partial((num_kv_heads, group), b - a, head_dim, q.device) for a, b in q_tiles]

    current = torch.zeros(2, n_max, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    current[0, :n_local], current[1, :n_local] = k, v
    incoming = torch.empty_like(current)
    for step in range(cp.size):
        source = (cp.rank - step) % cp.size
        pending = _ring_shift(current, incoming, cp) if step < cp.size - 1 else []
        length = lengths[source]
        if length > 0 and n_local > 0:
            k_blk = current[0, :length].float().permute(1, 2, 0).contiguous()  # [num_kv_heads, head_dim, m]
            v_blk = current[1, :length].float().permute(1, 0, 2).contiguous()  # [num_kv_heads, m, head_dim]
            _attend_block(q32, q_pos, q_tiles, states, k_blk.unsqueeze(1), v_blk.unsqueeze(1), all_positions[source],
                          causal, sliding_window)
        for work in pending:
            work.wait()
        current, incoming = incoming, current
    if n_local == 0:
        return torch.empty_like(q)
    out = torch.cat([finish_partial(s) for s in states], dim=2)
    return out.permute(2, 0, 1, 3).reshape(n_local, num_heads, head_dim).to(q.dtype)


# query rows per tile: the scores of one tile ([num_heads, 128, keys] float32) stay a few MiB, which ran 2x faster
# than whole chunks on the 2-core CPU of the issue (fewer page faults, warmer caches), and the causal diagonal of a
# chunk splits into tiles that are fully visible, partly masked or skipped
_Q_TILE = 128


def _attend_block(q32: torch.Tensor, q_pos: torch.Tensor, q_tiles: list[tuple[int, int]],
                  states: list[SoftmaxPartial], k_blk: torch.Tensor, v_blk: torch.Tensor, k_pos: torch.Tensor,
                  causal: bool, window: int | None) -> None:
    """Merge one circulated chunk into the states of every query tile, in place.

    q32 [num_kv_heads, group, n_local, head_dim] scaled queries; k_blk [num_kv_heads, 1, head_dim, m];
    v_blk [num_kv_heads, 1, m, head_dim]; q_pos [n_local] and k_pos [m] int64 global positions."""
    k_runs = _runs(k_pos)
    for i, (qa, qb) in enumerate(q_tiles):
        q0 = int(q_pos[qa])
        for ka, kb in k_runs:
            k0 = int(k_pos[ka])
            for sa, sb, masked in _segments(q0, qb - qa, k0, kb - ka, causal, window):
                scores = q32[:, :, qa:qb] @ k_blk[..., ka + sa:ka + sb]
                mask = _mask(q0, qb - qa, k0 + sa, sb - sa, window, q32.device) if masked else None
                states[i] = merge_partials(states[i], block_partial(scores, v_blk[:, :, ka + sa:ka + sb], mask))


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 sliding_window: int | None, positions: torch.Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [n_local, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must have q's dtype {q.dtype}, got k {k.dtype}, v {v.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's {q.shape[0]} rows, got {k.shape[0]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k's head_dim {k.shape[2]} differs from q's head_dim {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's num_heads {q.shape[1]} must be a multiple of k's num_kv_heads {k.shape[1]}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError(f"sliding_window must be >= 1 and used with causal=True, got {sliding_window} "
                         f"(causal={causal})")
    if positions is not None and (positions.dim() != 1 or positions.shape[0] != q.shape[0]
                                  or positions.dtype.is_floating_point or positions.dtype == torch.bool):
        raise ValueError(f"positions must be an integer tensor [n_local={q.shape[0]}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")


def _gather_layout(q: torch.Tensor, k: torch.Tensor, cp: ContextParallel, positions: torch.Tensor | None,
                   local_error: ValueError | None) -> tuple[list[int], list[torch.Tensor]]:
    """Every rank's chunk length and global positions ([length] int64 each), the same list on every rank.

    The ranks exchange their shapes and whether their own checks failed before anything else, so a bad input on
    one rank raises ValueError on every rank instead of leaving the others waiting in the ring: the failing rank
    raises its own error, the others name it; likewise where the ranks disagree on the heads or head_dim, pass
    positions on some ranks only, or hold a position twice."""
    if local_error is None:
        info = torch.tensor([0, positions is not None, q.shape[0], q.shape[1], k.shape[1], q.shape[2]],
                            dtype=torch.int64, device=q.device)
    else:
        info = torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.int64, device=q.device)
    infos = [info]
    if cp.size > 1:
        infos = [torch.empty_like(info) for _ in range(cp.size)]
        dist.all_gather(infos, info, group=cp.group)
    if local_error is not None:
        raise local_error
    refused = [r for r, i in enumerate(infos) if i[0]]
    if refused:
        raise ValueError(f"context parallel rank(s) {refused} refused their inputs (see their errors)")
    if len({tuple(i[3:].tolist()) for i in infos}) != 1:
        raise ValueError("q and k must have the same num_heads, num_kv_heads and head_dim on every rank, got "
                         f"{[tuple(i[3:].tolist()) for i in infos]}")
    if len({int(i[1]) for i in infos}) != 1:
        raise ValueError("positions must be given on every rank or on none")
    lengths = [int(i[2]) for i in infos]
    n_local = q.shape[0]
    if positions is None:
        starts = [sum(lengths[:r]) for r in range(cp.size)]
        return lengths, [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lengths, strict=True)]
    local = torch.full((max(lengths),), -1, dtype=torch.int64, device=q.device)
    local[:n_local] = positions
    gathered = [local]
    if cp.size > 1:
        gathered = [torch.empty_like(local) for _ in range(cp.size)]
        dist.all_gather(gathered, local, group=cp.group)
    every = [g[:n].cpu() for g, n in zip(gathered, lengths, strict=True)]
    flat = torch.cat(every)
    if flat.numel() and (flat.min() < 0 or flat.unique().numel() != flat.numel()):
        raise ValueError("positions must be >= 0 and each position held by one row of one rank")
    return lengths, every


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges [a, b) of `positions` [n] over which the positions rise by one (one per zigzag chunk)."""
    n = positions.shape[0]
    if n == 0:
        return []
    breaks = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, n]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _segments(q0: int, nq: int, k0: int, nk: int, causal: bool, window: int | None
              ) -> list[tuple[int, int, bool]]:
    """The keys that queries at positions q0 .. q0 + nq - 1 see among keys at k0 .. k0 + nk - 1, as index ranges
    [a, b) into the keys with whether they need a mask: a middle range every query sees whole, flanked by ranges
    (at most nq wide) some queries see. Keys no query sees (the future, or before every window) are left out, so a
    chunk wholly in the queries' future costs nothing."""
    if not causal:
        return [(0, nk, False)]
    w = window if window is not None else q0 + nq + 1  # unlimited: wider than any gap
    q_last = q0 + nq - 1
    lo, hi = max(k0, q0 - w + 1), min(k0 + nk, q_last + 1)  # some query sees [lo, hi)
    full_lo, full_hi = max(lo, q_last - w + 1), min(hi, q0 + 1)  # every query sees [full_lo, full_hi)
    if lo >= hi:
        return []
    if full_lo >= full_hi:
        spans = [(lo, hi, True)]
    else:
        spans = [(lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)]
    return [(a - k0, b - k0, masked) for a, b, masked in spans if a < b]


def _mask(q0: int, nq: int, k0: int, nk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[nq, nk] bool: True where the query at q0 + i sees the key at k0 + j (causal, within the window)."""
    gap = torch.arange(q0, q0 + nq, device=device).unsqueeze(1) - torch.arange(k0, k0 + nk, device=device)
    return (gap >= 0) & (gap < window) if window is not None else gap >= 0


def _ring_shift(send: torch.Tensor, recv: torch.Tensor, cp: ContextParallel) -> list[Any]:
    """Start sending `send` to rank + 1 and receiving into `recv` from rank - 1; returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, send, group=cp.group, group_peer=(cp.rank + 1) % cp.size),
           dist.P2POp(dist.irecv, recv, group=cp.group, group_peer=(cp.rank - 1) % cp.size)]
    return dist.batch_isend_irecv(ops)


@dataclass(slots=True)
class ContextParallelStep:
    """A step whose prefill chunks are split over a context-parallel ring (the engine's use of this module): every
    rank holds the whole model and the whole paged KV cache, and computes only its own share of each long enough
    prefill chunk; the step's other rows (decode and verify rows, short chunks) run whole on every rank. The engine
    splits a chunk by zigzag (`split_sequence_zigzag`'s order: rank r computes parts r and 2N - 1 - r of 2N, an
    early and a late one, so every rank holds about the same number of causal (query, key) pairs).

    Attention needs the keys and values of a chunk's earlier positions, which other ranks computed: at each layer the
    ranks' K/V shares travel round the ring as in ring attention (rank r sends to r + 1 and receives from r - 1, N - 1
    hops), each arriving share is written into this rank's paged cache, and once every share has arrived (a late
    part of the zigzag split needs every rank's early part) the rank attends its query rows over the cache with the
    engine's own attention backend. The attention is therefore the same computation as on one rank (the same kernel
    over the same cached K/V rows), not an online-softmax merge, and every rank's cache ends the step holding every
    chunk whole, so later steps (decode, prefix hits, the next chunk) run on any rank alike.

    The layout is known to every rank from the scheduler's output, so the ring exchanges no shapes. Attached to the
    step's AttentionMetadata (its `context_parallel` field) for the attention layers.
    """

    cp: ContextParallel
    # per rank: [rows] int64 slot in the paged cache of each row it exchanges (its shares of the split chunks)
    slots: list[torch.Tensor]
    # this rank's rows that it exchanges, as indices into its own batch; None = all of them (no whole rows)
    exchange_rows: torch.Tensor | None
    # per request in batch order: ("whole", first row in this rank's batch, rows), or ("split", [(rank, first row
    # among that rank's exchanged rows, rows) for each rank in order])
    pieces: list[tuple[str, Any, Any]]
    # per entry of this rank's attention metadata: the position that decides LongRoPE's table (a split chunk's last
    # position, else the entry's own last row's)
    longrope_ends: list[int]

    @property
    def rows_per_rank(self) -> list[int]:
        return [int(s.shape[0]) for s in self.slots]

    def attend(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, attend: Any) -> torch.Tensor:
        """Exchange this layer's K/V of the split chunks round the ring, writing each arriving share into kv_cache,
        then call `attend()` (the backend over this rank's rows, which writes its own rows as usual); returns its
        result.

        key, value: [rows of this rank's batch, num_kv_heads, head_dim] in the model dtype. Every rank of the ring
        must call it at the same layer (a collective)."""
        from loom.attention.backend import write_kv_cache

        cp = self.cp
        rows = self.rows_per_rank
        if self.exchange_rows is not None:
            key, value = key.index_select(0, self.exchange_rows), value.index_select(0, self.exchange_rows)
        current = torch.zeros(2, max(rows), *key.shape[1:], dtype=key.dtype, device=key.device)
        current[0, : key.shape[0]], current[1, : key.shape[0]] = key, value
        incoming = torch.empty_like(current)
        pending = _ring_shift(current, incoming, cp)
        for hop in range(1, cp.size):  # the share of rank r - hop arrives in hop `hop`
            for work in pending:
                work.wait()
            current, incoming = incoming, torch.empty_like(current)
            pending = _ring_shift(current, incoming, cp) if hop < cp.size - 1 else []
            source = (cp.rank - hop) % cp.size
            n = rows[source]
            write_kv_cache(current[0, :n], current[1, :n], kv_cache, self.slots[source], has_pad_slots=False)
        return attend()

    def gather_rows(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This rank's output rows [rows of its batch, hidden] -> on rank 0, the whole step's rows in batch order
        (every request's chunk whole, requests in order) [all rows, hidden]; None on the other ranks. A collective:
        every rank calls it, and sends its split rows to rank 0."""
        rows = self.rows_per_rank
        exchanged = hidden if self.exchange_rows is None else hidden.index_select(0, self.exchange_rows)
        padded = torch.zeros(max(rows), *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
        padded[: exchanged.shape[0]] = exchanged
        root = self.cp.rank == 0
        parts = [torch.empty_like(padded) for _ in range(self.cp.size)] if root else None
        dist.gather(padded, parts, dst=0, group=self.cp.group)
        if not root:
            return None
        assert parts is not None
        out = []
        for kind, a, b in self.pieces:
            if kind == "whole":
                out.append(hidden[a : a + b])
            else:
                out.extend(parts[rank][first : first + count] for rank, first, count in a)
        return torch.cat(out)
