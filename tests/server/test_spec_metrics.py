"""Speculative decoding counters (EngineStats.spec_*) in /metrics under vLLM's names."""

from __future__ import annotations

import re
from types import SimpleNamespace

from loom.server.metrics import ServerMetrics


def _value(text: str, name: str, extra: str = "") -> float:
    match = re.search(rf'^loom:{name}{{model_name="m"{extra}}} (\S+)$', text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def _stats(drafts: int, tokens: int, accepted: int, per_pos: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                           prefix_cache_hits=0, spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                           spec_num_accepted_tokens=accepted, spec_num_accepted_tokens_per_pos=per_pos,
                           spec_num_branches=2 * drafts, spec_num_branch_wins=drafts - 1)


def test_spec_counters_follow_the_engine_totals() -> None:
    metrics = ServerMetrics("m")
    for drafts, tokens, accepted, per_pos in ((2, 8, 5, (2, 2, 1, 0)), (3, 12, 6, (3, 2, 1, 0))):
        metrics.on_step([], _stats(drafts, tokens, accepted, per_pos), now=0.0)
        text = metrics.render().decode()
        assert _value(text, "spec_decode_num_drafts_total") == drafts
        assert _value(text, "spec_decode_num_draft_tokens_total") == tokens
        assert _value(text, "spec_decode_num_accepted_tokens_total") == accepted
        assert _value(text, "spec_decode_num_branches_total") == 2 * drafts  # tree candidates
        assert _value(text, "spec_decode_num_branch_wins_total") == drafts - 1
        for pos, count in enumerate(per_pos):
            got = _value(text, "spec_decode_num_accepted_tokens_per_pos_total", f',position="{pos}"')
            assert got == count


def test_spec_counters_stay_zero_without_speculation() -> None:
    metrics = ServerMetrics("m")
    metrics.on_step([], SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                                        prefix_cache_hits=0), now=0.0)
    assert _value(metrics.render().decode(), "spec_decode_num_accepted_tokens_total") == 0.0
