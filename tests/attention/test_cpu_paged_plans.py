"""The cpu_paged backend's per-step attention plans: one per (metadata, window) within a step, none kept past it."""

from __future__ import annotations

import torch

from loom.attention import build_attention_metadata
from loom.attention.cpu_paged import CpuPagedBackend


def test_plans_are_per_metadata_and_window_and_dropped_with_their_step() -> None:
    backend = CpuPagedBackend()
    step1 = build_attention_metadata([3, 1], [3, 9], [[0], [1, 2, 3]], 4, torch.device("cpu"))
    # a hybrid KV cache's second group: its own tables, the same step (the same query_start_loc_cpu list)
    group2 = build_attention_metadata([3, 1], [3, 9], [[4], [5, 6, 7]], 4, torch.device("cpu"))
    group2.query_start_loc_cpu = step1.query_start_loc_cpu
    a = backend._step_plan(step1, None, torch.float32)
    assert backend._step_plan(step1, None, torch.float32) is a  # reused by every layer
    b = backend._step_plan(step1, 4, torch.float32)
    c = backend._step_plan(group2, 4, torch.float32)
    assert len({id(a), id(b), id(c)}) == 3 and len(backend._plans) == 3
    assert torch.equal(c.decode.block_ids, torch.tensor([[5, 6, 7]]))
    step2 = build_attention_metadata([1], [4], [[0]], 4, torch.device("cpu"))
    backend._step_plan(step2, None, torch.float32)
    assert len(backend._plans) == 1  # the last step's plans (and their masks) are let go
