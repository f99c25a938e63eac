"""The scheduler's fair-share preemptions (loom/core/scheduler.py) reach EngineStats and Prometheus."""

from __future__ import annotations

from loom.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.sampling_params import SamplingParams
from loom.server.metrics import ServerMetrics
from tests.helpers import save_tiny_model


def test_copies_giving_a_seat_to_another_request_are_counted_and_exported(tmp_path, hf_tokenizer) -> None:
    model = save_tiny_model(tmp_path / "llama", "llama", hf_tokenizer, seed=5)
    engine = LLMEngine(EngineArgs(model=str(model), dtype="float32", num_kv_blocks=64, max_num_seqs=2))
    engine.add_request("copies", [5, 6, 7, 8], SamplingParams(n=4, temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.step()
    engine.step()  # the 4 copies hold both seats
    engine.add_request("late", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    late_done_at, steps = None, 0
    while engine.has_unfinished_requests():
        steps += 1
        if any(o.request_id == "late" and o.finished for o in engine.step()):
            late_done_at = steps
    stats = engine.get_stats()
    assert late_done_at is not None and late_done_at <= 8  # it got a seat long before the copies ended
    assert stats.num_fair_share_preemptions == engine.scheduler.num_fair_share_preemptions >= 1
    assert stats.num_preemptions >= stats.num_fair_share_preemptions
    assert stats.num_free_blocks == stats.num_blocks
    metrics = ServerMetrics("tiny")
    metrics.on_step([], stats, 0.0)
    text = metrics.render().decode()
    assert (f'loom:num_fair_share_preemptions_total{{model_name="tiny"}} '
            f'{float(stats.num_fair_share_preemptions)}') in text
