"""Prometheus metrics of one server (one CollectorRegistry per app; names follow vLLM's with `loom:`).

All latencies are seconds measured with time.monotonic(); TTFT and E2E latency count from the
request's arrival at the engine front, queue time until it was first scheduled.
Updated from the engine thread (prometheus_client is thread-safe) through `on_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loom.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The `loom:` metric family for one served model, in its own registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"loom:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first generated token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last output.", _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first scheduled.",
                               _LATENCY_BUCKETS)
        self.running = Gauge("loom:num_requests_running", "Requests in the running batch.", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("loom:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("loom:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", labels,
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("loom:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("loom:generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter("loom:request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prefix_queries = Counter("loom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r).labels(model_name)
        self.prefix_hits = Counter("loom:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r).labels(model_name)
        self.preemptions = Counter("loom:num_preemptions", "Requests preempted (KV blocks reclaimed).", labels,
                                   registry=r).labels(model_name)
        self.fair_share_preemptions = Counter(
            "loom:num_fair_share_preemptions", "Preemptions of one request's n copies to give another user request "
            "a seat (a subset of loom:num_preemptions).", labels, registry=r).labels(model_name)
        self.kv_offloaded = Counter("loom:kv_blocks_offloaded", "KV blocks copied from the device to the host tier.",
                                    labels, registry=r).labels(model_name)
        self.kv_restored = Counter("loom:kv_blocks_restored", "KV blocks copied from the host tier to the device.",
                                   labels, registry=r).labels(model_name)
        self.kv_recomputed = Counter("loom:kv_blocks_recomputed",
                                     "Computed KV blocks dropped by preemption (to be recomputed).", labels,
                                     registry=r).labels(model_name)
        self.kv_retention_dropped = Counter("loom:kv_retention_blocks_dropped",
                                            "KV blocks dropped by KV retention policies (sinks, h2o, snapkv).",
                                            labels, registry=r).labels(model_name)
        # speculative decoding, vLLM's names (zero when it is off)
        self.spec_drafts = Counter("loom:spec_decode_num_drafts", "Verify passes that carried draft tokens.",
                                   labels, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter("loom:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels,
                                         registry=r).labels(model_name)
        self.spec_accepted = Counter("loom:spec_decode_num_accepted_tokens", "Draft tokens kept by verification.",
                                     labels, registry=r).labels(model_name)
        self._spec_per_pos = Counter("loom:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens kept, by position in the draft.", ["model_name", "position"],
                                     registry=r)
        # tree candidates (loom's own names; equal to spec_decode_num_drafts / zero without them)
        self.spec_branches = Counter("loom:spec_decode_num_branches", "Candidate draft branches verified.", labels,
                                     registry=r).labels(model_name)
        self.spec_branch_wins = Counter("loom:spec_decode_num_branch_wins",
                                        "Verify passes whose kept tokens came from a branch other than the first.",
                                        labels, registry=r).labels(model_name)
        # mixture of experts: routings per expert and the load imbalance (hottest expert over the mean; 1 = even)
        self._moe_tokens = Counter("loom:moe_expert_tokens", "Tokens routed to each expert, summed over the MoE "
                                   "layers.", ["model_name", "expert"], registry=r)
        self.moe_imbalance = Gauge("loom:moe_expert_load_imbalance", "Routings of the most-used expert over the mean "
                                   "(1 = balanced), since start-up.", labels, registry=r).labels(model_name)
        # prefill/decode disaggregation (loom/kv_transfer; zero without --kv-transfer-role)
        self.kv_transfer_pinned = Gauge("loom:kv_transfer_pinned", "Finished prefills whose KV blocks wait for a "
                                        "decode replica to pull them.", labels, registry=r).labels(model_name)
        self._kv_transfer = [Counter(f"loom:{name}", doc, labels, registry=r).labels(model_name) for name, doc in (
            ("kv_transfer_expired", "Pinned transfers freed unread after --kv-transfer-timeout."),
            ("kv_transfer_pulls", "Prompts whose KV blocks were pulled from a prefill replica."),
            ("kv_transfer_pull_failures", "Pulls that failed (the prompt was computed here instead)."),
            ("kv_transfer_blocks_loaded", "KV blocks pulled and written instead of computed."))]
        self._last_kv_transfer = [0, 0, 0, 0]
        self._last_moe: list[int] = []
        self._last_spec = (0, 0, 0, 0, 0)
        self._last_spec_pos: list[int] = []
        self._seen: dict[str, float | None] = {}  # request_id -> last_token_time seen (engine thread only)
        self._last_queries = 0  # cumulative engine counters at the previous step
        self._last_hits = 0
        self._last_preemptions = 0
        self._last_fair_share = 0
        self._last_offloaded = 0
        self._last_restored = 0
        self._last_recomputed = 0
        self._last_retention_dropped = 0

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def on_step(self, outputs: Sequence[RequestOutput], stats: Any, now: float) -> None:
        """Record one engine step: per-request latencies and token counts, then the engine gauges."""
        for out in outputs:
            self._record_output(out, now)
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self._last_queries = _advance(self.prefix_queries, stats.prefix_cache_queries, self._last_queries)
        self._last_hits = _advance(self.prefix_hits, stats.prefix_cache_hits, self._last_hits)
        self._last_preemptions = _advance(self.preemptions, getattr(stats, "num_preemptions", 0),
                                          self._last_preemptions)
        self._last_fair_share = _advance(self.fair_share_preemptions,
                                         getattr(stats, "num_fair_share_preemptions", 0), self._last_fair_share)
        # Host offload tier (EngineStats.num_blocks_*; zero on engines without the tier).
        self._last_offloaded = _advance(self.kv_offloaded, getattr(stats, "num_blocks_offloaded", 0),
                                        self._last_offloaded)
        self._last_restored = _advance(self.kv_restored, getattr(stats, "num_blocks_restored", 0),
                                       self._last_restored)
        self._last_recomputed = _advance(self.kv_recomputed, getattr(stats, "num_blocks_recomputed", 0),
                                         self._last_recomputed)
        self._last_retention_dropped = _advance(self.kv_retention_dropped,
                                                getattr(stats, "kv_retention_blocks_dropped", 0),
                                                self._last_retention_dropped)
        self.kv_transfer_pinned.set(getattr(stats, "kv_transfer_pinned", 0))
        for i, name in enumerate(("kv_transfer_expired", "kv_transfer_pulls", "kv_transfer_pull_failures",
                                  "kv_transfer_blocks_loaded")):
            self._last_kv_transfer[i] = _advance(self._kv_transfer[i], getattr(stats, name, 0),
                                                 self._last_kv_transfer[i])
        self._last_spec = (
            _advance(self.spec_drafts, getattr(stats, "spec_num_drafts", 0), self._last_spec[0]),
            _advance(self.spec_draft_tokens, getattr(stats, "spec_num_draft_tokens", 0), self._last_spec[1]),
            _advance(self.spec_accepted, getattr(stats, "spec_num_accepted_tokens", 0), self._last_spec[2]),
            _advance(self.spec_branches, getattr(stats, "spec_num_branches", 0), self._last_spec[3]),
            _advance(self.spec_branch_wins, getattr(stats, "spec_num_branch_wins", 0), self._last_spec[4]),
        )
        moe = list(getattr(stats, "moe_expert_tokens", ()))
        if moe and sum(moe):
            self._last_moe += [0] * (len(moe) - len(self._last_moe))
            for expert, total in enumerate(moe):
                counter = self._moe_tokens.labels(self.model_name, str(expert))
                self._last_moe[expert] = _advance(counter, total, self._last_moe[expert])
            self.moe_imbalance.set(max(moe) * len(moe) / sum(moe))
        per_pos = list(getattr(stats, "spec_num_accepted_tokens_per_pos", ()))
        self._last_spec_pos += [0] * (len(per_pos) - len(self._last_spec_pos))
        for pos, total in enumerate(per_pos):
            counter = self._spec_per_pos.labels(self.model_name, str(pos))
            self._last_spec_pos[pos] = _advance(counter, total, self._last_spec_pos[pos])

    def _record_output(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        self.generation_tokens.inc(new_tokens)
        first = out.request_id not in self._seen
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self._seen[out.request_id] = None
            if m is not None and m.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m is not None and m.last_token_time is not None:
            prev = self._seen[out.request_id]
            if prev is None and m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            elif prev is not None and m.last_token_time > prev:
                per_sample = max(1, max((len(c.delta_token_ids) for c in out.outputs), default=1))
                gap = (m.last_token_time - prev) / per_sample
                for _ in range(per_sample):
                    self.itl.observe(gap)
            self._seen[out.request_id] = m.last_token_time
        if out.finished:
            self._seen.pop(out.request_id, None)
            end = m.finished_time if m is not None and m.finished_time is not None else now
            if m is not None:
                self.e2e.observe(max(0.0, end - m.arrival_time))
            for c in out.outputs:
                self._success.labels(self.model_name, c.finish_reason or "abort").inc()

    def forget(self, request_id: str) -> None:
        """Drop per-request state of a request that ended without a finished output (abort)."""
        self._seen.pop(request_id, None)


def _advance(counter: Any, cumulative: int, last: int) -> int:
    """Increase `counter` by the growth of an engine-side cumulative count; returns the new baseline."""
    if cumulative > last:
        counter.inc(cumulative - last)
    return max(cumulative, last) if cumulative >= last else cumulative


__all__ = ["ServerMetrics"]
