"""Ring attention (context parallel) against single-process attention on the whole sequence.

Two and three gloo processes (one thread each) run every case in one launch per world size; each rank saves its
output rows and their global positions, and the test assembles the sequence and compares it with
scaled_dot_product_attention under the causal (and sliding-window) mask, GQA by repeating the KV heads.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.distributed.context_parallel import (ContextParallel, SoftmaxPartial, _segments, block_partial,
                                               empty_partial, finish_partial, merge_partials, ring_attention,
                                               split_sequence, split_sequence_zigzag)

pytestmark = pytest.mark.timeout(180)


class Case(NamedTuple):
    n: int  # tokens in the whole sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: int | None  # sliding window, tokens
    zigzag: bool  # split_sequence_zigzag instead of split_sequence
    dtype: torch.dtype


CASES = {
    "causal_mha": Case(64, 4, 4, 16, True, None, False, torch.float32),
    "noncausal_gqa": Case(64, 8, 2, 16, False, None, False, torch.float32),
    "causal_gqa_uneven_37": Case(37, 6, 3, 8, True, None, False, torch.float32),
    "noncausal_uneven_37": Case(37, 4, 1, 8, False, None, False, torch.float32),
    "sliding_window_7": Case(50, 4, 2, 16, True, 7, False, torch.float32),
    "sliding_window_over_chunks": Case(61, 2, 1, 8, True, 29, False, torch.float32),
    "zigzag_causal_gqa": Case(64, 8, 2, 16, True, None, True, torch.float32),
    "zigzag_uneven_window": Case(41, 4, 2, 8, True, 11, True, torch.float32),
    "fewer_tokens_than_chunks": Case(2, 2, 1, 8, True, None, False, torch.float32),
    "tiled_window_601": Case(601, 2, 1, 8, True, 200, False, torch.float32),  # several 128-row query tiles
    "tiled_zigzag_noncausal_700": Case(700, 4, 2, 8, False, None, True, torch.float32),
    "tiled_zigzag_causal_700": Case(700, 2, 2, 8, True, None, True, torch.float32),
    "bf16_causal_gqa": Case(48, 4, 2, 32, True, None, False, torch.bfloat16),
}


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.n * 1000 + case.num_heads * 10 + case.head_dim)
    q = torch.randn(case.n, case.num_heads, case.head_dim, generator=g)
    k = torch.randn(case.n, case.num_kv_heads, case.head_dim, generator=g)
    v = torch.randn(case.n, case.num_kv_heads, case.head_dim, generator=g)
    return q.to(case.dtype), k.to(case.dtype), v.to(case.dtype)


def _reference(case: Case) -> torch.Tensor:
    q, k, v = (t.float() for t in _inputs(case))
    group = case.num_heads // case.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None
    if case.causal:
        gap = torch.arange(case.n).unsqueeze(1) - torch.arange(case.n).unsqueeze(0)
        mask = (gap >= 0) & (gap < (case.window or math.inf))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=case.head_dim ** -0.5)
    return out.transpose(0, 1)


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        cp = ContextParallel(rank, size)
        results = {}
        for name, case in CASES.items():
            q, k, v = _inputs(case)
            pos = (split_sequence_zigzag if case.zigzag else split_sequence)(case.n, cp)
            out = ring_attention(q[pos], k[pos], v[pos], cp, scale=case.head_dim ** -0.5, causal=case.causal,
                                 sliding_window=case.window, positions=pos if case.zigzag else None)
            results[name] = (pos, out)
        # ranks that disagree on the heads raise alike instead of waiting on each other
        try:
            ring_attention(torch.zeros(4, 2 + 2 * rank, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), cp, scale=1.0)
            results["disagree"] = "no error"
        except ValueError as e:
            results["disagree"] = str(e)
        # one rank's bad input (head_dim 8 vs 6) raises on every rank; the ring still works afterwards
        kv = torch.zeros(4, 2, 8 - 2 * (rank == 1))
        try:
            ring_attention(torch.zeros(4, 2, 8), kv, kv, cp, scale=1.0)
            results["one_refuses"] = "no error"
        except ValueError as e:
            results["one_refuses"] = str(e)
        q, k, v = _inputs(CASES["causal_mha"])
        pos = split_sequence(CASES["causal_mha"].n, cp)
        results["after_errors"] = (pos, ring_attention(q[pos], k[pos], v[pos], cp, scale=16 ** -0.5))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda s: f"{s}ranks")
def ring_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    size = request.param
    out_dir = tmp_path_factory.mktemp(f"cp{size}")
    mp.spawn(_worker, args=(size, _free_port(), str(out_dir)), nprocs=size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_single_rank(name: str, ring_results: list[dict]) -> None:
    case = CASES[name]
    got = torch.full((case.n, case.num_heads, case.head_dim), math.nan)
    for results in ring_results:
        pos, out = results[name]
        assert out.dtype == case.dtype and out.shape == (pos.shape[0], case.num_heads, case.head_dim)
        got[pos] = out.float()
    want = _reference(case)
    if case.dtype == torch.float32:
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"max abs error {err}"
    else:  # accumulated in float32: within one bfloat16 ulp of the float32 result rounded
        want = want.to(case.dtype).float()
        assert ((got - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()


def test_bad_input_on_one_rank_raises_on_every_rank(ring_results: list[dict]) -> None:
    assert all("num_heads" in r["disagree"] for r in ring_results)  # ranks disagree on the heads
    assert "head_dim" in ring_results[1]["one_refuses"]
    assert all("rank(s) [1] refused" in r["one_refuses"] for i, r in enumerate(ring_results) if i != 1)
    got = torch.cat([r["after_errors"][1] for r in ring_results])
    assert (got - _reference(CASES["causal_mha"])).abs().max() < 1e-5


def test_splits_cover_the_sequence_once() -> None:
    for n in (0, 1, 5, 37, 64):
        for size in (1, 2, 3, 4):
            for split in (split_sequence, split_sequence_zigzag):
                parts = [split(n, ContextParallel(r, size)) for r in range(size)]
                assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))
                assert all(torch.equal(p, p.sort().values) for p in parts)
    # zigzag: rank r holds chunks r and 2 * size - 1 - r of 2 * size
    assert split_sequence_zigzag(8, ContextParallel(0, 2)).tolist() == [0, 1, 6, 7]
    assert split_sequence_zigzag(8, ContextParallel(1, 2)).tolist() == [2, 3, 4, 5]
    assert split_sequence(37, ContextParallel(0, 2)).tolist() == list(range(19))


def test_segments_skip_future_keys_and_mask_only_the_edges() -> None:
    # queries at 100..227 against keys 300..399 (their future): nothing to compute
    assert _segments(100, 128, 300, 100, True, None) == []
    # keys 0..99 all in the past of every query: one unmasked range; non-causal sees everything
    assert _segments(100, 128, 0, 100, True, None) == [(0, 100, False)]
    assert _segments(100, 128, 300, 100, False, None) == [(0, 100, False)]
    # the diagonal: keys 0..100 seen by all, 101..227 masked (128 - 1 wide), 228.. skipped
    assert _segments(100, 128, 0, 400, True, None) == [(0, 101, False), (101, 228, True)]
    # window 50: queries 100..227 see keys 51..227; all of them see none of 0..50 and 178..100 is empty
    assert _segments(100, 128, 0, 400, True, 50) == [(51, 228, True)]
    # window 200: keys 28..100 are seen by all, 0..27 and 101..227 by some
    assert _segments(100, 128, 0, 400, True, 200) == [(0, 28, True), (28, 101, False), (101, 228, True)]


def test_online_softmax_merge_equals_softmax_over_all_keys() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 5, 40, generator=g) * 4
    v = torch.randn(3, 40, 7, generator=g)
    mask = torch.rand(5, 40, generator=g) > 0.3
    mask[2] = False  # a row that sees no key at all
    want = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0) @ v
    edges = [0, 3, 4, 17, 30, 40]
    state = empty_partial((3,), 5, 7)
    for a, b in reversed(list(zip(edges[:-1], edges[1:]))):  # any order of disjoint blocks
        state = merge_partials(state, block_partial(scores[..., a:b], v[:, a:b], mask[:, a:b]))
    assert (finish_partial(state) - want).abs().max() < 1e-6
    assert not finish_partial(state).isnan().any()


def test_merge_rescales_to_the_larger_maximum() -> None:
    one = SoftmaxPartial(torch.tensor([[2.0]]), torch.tensor([0.0]), torch.tensor([1.0]))  # score 0 -> value 2
    two = SoftmaxPartial(torch.tensor([[4.0]]), torch.tensor([math.log(3.0)]), torch.tensor([1.0]))  # score ln 3
    merged = merge_partials(one, two)
    assert merged.row_max.item() == pytest.approx(math.log(3.0))
    assert finish_partial(merged).item() == pytest.approx((1 * 2 + 3 * 4) / 4)


def test_single_rank_ring_is_plain_attention() -> None:
    case = CASES["sliding_window_7"]
    q, k, v = _inputs(case)
    out = ring_attention(q, k, v, ContextParallel(0, 1), scale=case.head_dim ** -0.5, sliding_window=case.window)
    assert (out - _reference(case)).abs().max() < 1e-5


@pytest.mark.parametrize("args, kwargs, word", [
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)), {}, "head_dim"),
    ((torch.zeros(4, 3, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {}, "num_heads"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)), {}, "v must"),
    ((torch.zeros(4, 4, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)), {}, "k must"),
    ((torch.zeros(4, 4), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {}, "q must"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8, dtype=torch.float64), torch.zeros(4, 2, 8)), {}, "k must"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {"scale": 0.0}, "scale"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {"sliding_window": 0}, "sliding_window"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {"sliding_window": 4, "causal": False},
     "sliding_window"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), {"positions": torch.arange(3)},
     "positions"),
    ((torch.zeros(4, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)),
     {"positions": torch.tensor([0, 1, 1, 2])}, "positions"),
])
def test_bad_input_raises_naming_the_argument(args: tuple, kwargs: dict, word: str) -> None:
    kwargs = {"scale": 1.0} | kwargs
    with pytest.raises(ValueError, match=word):
        ring_attention(*args, ContextParallel(0, 1), **kwargs)


def test_bad_group_and_split_arguments() -> None:
    with pytest.raises(ValueError, match="rank"):
        ContextParallel(2, 2)
    with pytest.raises(ValueError, match="n must"):
        split_sequence(-1, ContextParallel(0, 2))
