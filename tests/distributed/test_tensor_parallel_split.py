"""How matrices split over tensor-parallel ranks, and the per-step diff rank 0 sends its workers (no processes)."""

from __future__ import annotations

import pytest
import torch

from loom.core.sched_output import ScheduledRequest, SchedulerOutput
from loom.distributed.tensor_parallel import TensorParallel, head_shard, max_kv_heads_per_rank, partition
from loom.executor.step_message import StepDecoder, StepEncoder
from loom.quant.layout import dequantize, pack_q4g
from loom.sampling_params import SamplingParams


def test_partition_covers_every_item_once_first_ranks_larger() -> None:
    for n in (1, 5, 9, 49152, 4864):
        for size in (2, 3, 4):
            ranges = [partition(n, size, r) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            widths = [b - a for a, b in ranges]
            assert max(widths) - min(widths) <= 1 and widths == sorted(widths, reverse=True)


def test_heads_split_by_whole_kv_groups_even_unevenly() -> None:
    # SmolLM2: 9 query heads, 3 KV heads, over 2 ranks: KV heads {0, 1} with q 0..5, and KV head {2} with q 6..8
    a, b = (head_shard(9, 3, TensorParallel(r, 2)) for r in range(2))
    assert (a.q_start, a.num_heads, a.kv_start, a.num_kv_heads) == (0, 6, 0, 2)
    assert (b.q_start, b.num_heads, b.kv_start, b.num_kv_heads) == (6, 3, 2, 1)
    assert max_kv_heads_per_rank(9, 3, 2) == 2


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head() -> None:
    # Qwen2.5-0.5B: 14 query heads, 2 KV heads; 4 ranks would need 14 % 4 == 0: refused; 8 heads / 2 KV over 4
    shards = [head_shard(8, 2, TensorParallel(r, 4)) for r in range(4)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shards] == \
        [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    # every query head's KV head (q // group) is the one its rank holds
    for s in shards:
        assert all(q // 4 == s.kv_start for q in range(s.q_start, s.q_start + s.num_heads))
    with pytest.raises(ValueError, match="tensor_parallel_size 4 with 2 KV heads and 14 query heads"):
        head_shard(14, 2, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="size >= 2"):
        TensorParallel(0, 1)


def test_packed_columns_equal_the_dequantized_slice_and_refuse_mid_group() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 128), generator=gen)
    scales = torch.rand(5, 4, generator=gen).to(torch.float16)
    mins = -torch.rand(5, 4, generator=gen).to(torch.float16)
    packed = pack_q4g(codes, scales, mins)
    assert torch.equal(dequantize(packed.cols(32, 96)), dequantize(packed)[:, 32:96])
    with pytest.raises(ValueError, match="group boundaries"):
        packed.cols(16, 64)


def _req(rid: str, tokens: list[int], start: int, table: list[int], is_new: bool, **kw) -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=tokens, start_position=start, block_table=table, sample=True,
                            sampling_params=SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3, 4, 5],
                            output_token_ids=[], is_new=is_new, **kw)


def _same(a: ScheduledRequest, b: ScheduledRequest) -> None:
    for name in ("request_id", "token_ids", "start_position", "block_table", "sample", "prompt_token_ids",
                 "spec_token_ids", "spec_branches", "group_block_tables"):
        assert getattr(a, name) == getattr(b, name), name


def test_step_diff_reproduces_every_step_and_sends_prompts_once() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    steps = [
        [_req("a", [1, 2, 3, 4, 5], 0, [7, 8], True)],
        [_req("a", [9], 5, [7, 8], False), _req("b", [1, 2], 0, [3], True)],
        [_req("a", [9, 4, 4], 6, [7, 8, 11], False, spec_token_ids=[4, 4])],  # a lookahead block
        [_req("a", [4], 7, [7, 8], False), _req("b", [5], 2, [3], False)],  # drafts rejected: the table shrank
        # sliding-window style: an early block replaced; a hybrid request with two groups
        [_req("a", [6], 8, [0, 8, 12], False),
         _req("c", [1], 0, [5], True, group_block_tables=[[5], [6]])],
    ]
    messages = []
    for i, scheduled in enumerate(steps):
        out = SchedulerOutput(scheduled, sum(len(r.token_ids) for r in scheduled),
                              finished_req_ids=["b"] if i == 4 else [], blocks_to_copy=[(1, 2)] if i == 2 else [])
        msg = enc.encode(out)
        messages.append(msg)
        got = dec.decode(msg)
        assert got.blocks_to_copy == out.blocks_to_copy and got.total_num_scheduled_tokens == out.total_num_scheduled_tokens
        for want, have in zip(scheduled, got.scheduled, strict=True):
            _same(want, have)
    assert [len(m.new_requests) for m in messages] == [1, 1, 0, 0, 1]
    assert messages[1].requests[0].table_edits == [(2, [])]  # nothing new for a: no ids sent
    assert messages[4].requests[0].table_edits == [(0, [0, 8, 12])]
    assert enc.num_tracked == dec.num_tracked == 2  # b finished: forgotten on both sides


def test_preempted_request_is_sent_whole_again_on_readmission() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    dec.decode(enc.encode(SchedulerOutput([_req("a", [1, 2, 3], 0, [4], True)], 3)))
    dec.decode(enc.encode(SchedulerOutput([], 0, preempted_req_ids=["a"])))
    assert enc.num_tracked == dec.num_tracked == 0
    msg = enc.encode(SchedulerOutput([_req("a", [1, 2, 3, 9], 0, [6], True)], 4))
    assert len(msg.new_requests) == 1 and msg.requests[0].table_edits == [(0, [6])]
    assert dec.decode(msg).scheduled[0].block_table == [6]
