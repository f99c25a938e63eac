"""The scheduler: each step, a token budget shared by running then waiting requests.

Model (vLLM v1, docs/design/v1 scheduler): there is no prefill/decode phase. Every request moves its
num_computed_tokens towards num_tokens; a step gives each request some tokens:
  1. RUNNING requests in admission order get min(num_tokens - num_computed_tokens, budget left).
     When the KV pool cannot hold them, the most recently admitted running request is preempted: its
     blocks are freed and it goes back to the front of the waiting queue; in recompute mode its K/V
     are computed again on resumption, in swap mode they are parked in the host tier and copied back
     (recompute when the host tier is full).
  2. WAITING requests are admitted while budget and seats (max_num_seqs) remain and no preemption
     happened this step, in FIFO order among the user requests holding the fewest seats (the n copies of
     one request are one user request): prefix-cache lookup and allocation go together; a prompt longer
     than the budget left gets the chunk that fits (chunked prefill). A user request that holds no seat
     and finds none free takes one from a request whose copies hold more than their share (_share_seats).
num_computed_tokens is advanced when a request is scheduled, not when the runner returns: the runner
computes exactly the scheduled tokens, and the next schedule() can then be built from the request
alone. Plain Python, no torch.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable

from loom.config import CacheConfig, SchedulerConfig
from loom.core.kv_cache_manager import ComputedPrefix, HybridKVCacheManager, KVCacheManager
from loom.core.kv_pinning import PinnedKVTable, PinnedTransfer
from loom.core.kv_retention import KVRetentionConfig, KVRetentionPolicy, RetentionState, get_retention_policy
from loom.core.offload import OffloadCounters
from loom.core.sched_output import (
    EngineCoreOutput,
    KVBlockLoad,
    ModelRunnerOutput,
    PinnedKV,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from loom.core.stop import check_stop
from loom.kv_transfer.base import prompt_digest
from loom.request import Request, RequestStatus
from loom.spec.proposer import DraftGrammar, DraftRequest, Proposer


MAX_PINNED_FRACTION = 0.5  # most of the KV pool that finished prefills may keep pinned for decode replicas

class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already (the server answers 503/429)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


SPEC_MAX_BACKOFF = 16  # most decode steps a request goes without drafts after verify passes that kept none
SPEC_ACCEPT_DECAY = 0.8  # weight of a request's earlier verify passes in its running acceptance


class SpecDecodeStats:
    """Speculative decoding counters, cumulative (vLLM's spec_decode_* metrics)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # verify passes that carried drafts (one per request and step)
        self.num_draft_tokens = 0  # tokens proposed
        self.num_accepted_tokens = 0  # drafts the target kept
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens  # kept drafts at position 0, 1, ...
        self.num_branches = 0  # candidate branches verified (tree candidates: one or more per verify pass)
        self.num_branch_wins = 0  # verify passes whose kept run came from a branch other than branch 0

    def record(self, num_drafts: int, num_accepted: int, num_branches: int = 1, branch: int = 0) -> None:
        """num_drafts: tokens of the branch kept from (drafts of the others count in num_branches only)."""
        self.num_drafts += 1
        self.num_branches += num_branches
        self.num_branch_wins += branch > 0
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over proposed drafts, in [0, 1] (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify pass: 1 + kept drafts on average (1 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Scheduler:
    """Decides which tokens of which requests the model runner computes each step."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        spec_disable_by_batch_size: int | None = None,
        spec_tree_width: int = 1,
        draft_grammar: DraftGrammar | None = None,
        kv_group_windows: list[int | None] | None = None,
        kv_transfer_timeout_s: float = 120.0,
        kv_retention_refused: str | None = None,
    ) -> None:
        """Args:
        num_blocks: KV blocks in the pool (from the runner's memory budget or cache_config).
        num_host_blocks: blocks of the host tier (from the runner's kv_offload budget); 0 = none.
        sliding_window: the model's attention window in tokens (blocks outside it are freed early); None = none.
        proposer: drafts tokens for decoding requests (speculative decoding, loom/spec); None = off.
        num_speculative_tokens: most drafts per request and step (k).
        spec_disable_by_batch_size: no drafts in a step while at least this many requests run; None = never.
        spec_tree_width: most candidate branches per greedy request and step (tree candidates); 1 = one chain.
        draft_grammar: truncates a structured-output request's drafts to the prefix its grammar accepts;
            None = such requests get no drafts.
        kv_group_windows: each KV cache group's sliding window (loom/core/kv_groups.py), two or more groups: a
            hybrid KV cache (HybridKVCacheManager; sliding_window and num_host_blocks must then be unset);
            None = one group.
        kv_retention_refused: what makes lossy KV retention impossible on this engine (e.g. "a model with
            sliding-window layers"), named in the error a request asking for it gets; None = nothing.
        kv_transfer_timeout_s: seconds a finished request's blocks stay pinned for a decode replica to pull
            (requests with kv_transfer_id; prefill/decode disaggregation) before they are freed unread.
        """
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len  # tokens
        self.num_blocks = num_blocks  # KV blocks in the pool
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if kv_group_windows is not None and len(kv_group_windows) > 1:
            if num_host_blocks or sliding_window is not None:
                raise ValueError("a hybrid KV cache takes its windows per group and has no host tier")
            self.kv_cache_manager = HybridKVCacheManager(
                num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_group_windows)
        else:
            self.kv_cache_manager = KVCacheManager(
                num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, num_host_blocks,
                sliding_window)
        self.kv_group_windows = kv_group_windows if kv_group_windows is not None and len(kv_group_windows) > 1 \
            else None
        self.requests: dict[str, Request] = {}  # request_id -> unfinished request
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests go to the front
        self.running: list[Request] = []  # admission order
        self._finished_req_ids: list[str] = []  # ended since the last schedule()
        self._prompt_logprobs_sent: dict[str, int] = {}  # request_id -> prompt logprobs passed on so far
        self._prompt_logprobs_seen: dict[str, int] = {}  # request_id -> prompt logprobs received since admission
        self.num_preemptions_total = 0  # cumulative
        self.num_fair_share_preemptions = 0  # of them, copies preempted to give a waiting request a seat
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.spec_stats = SpecDecodeStats(self.num_speculative_tokens)
        # request_id -> (decode steps left without drafts, current back-off): a verify pass that kept no draft
        # costs its extra rows for nothing, so the request waits 1, 2, 4 .. SPEC_MAX_BACKOFF steps before
        # drafting again; a kept draft resets it
        self._spec_backoff: dict[str, tuple[int, int]] = {}
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.spec_tree_width = spec_tree_width
        self.draft_grammar = draft_grammar
        # request_id -> decayed (accepted drafts, trials): a verify pass that kept j of d drafts is j
        # acceptances and, when j < d, one rejection; their ratio estimates the per-token acceptance a
        # that sets the request's k (see _draft_limit)
        self._spec_accept: dict[str, tuple[float, float]] = {}
        # disaggregation: prompt blocks of finished requests kept for a decode replica (read from the KV transfer
        # server's threads), and this step's pulled blocks to load
        self.pinned_kv = PinnedKVTable(kv_transfer_timeout_s)
        self._kv_loads: list[KVBlockLoad] = []
        self.num_kv_blocks_loaded = 0  # pulled blocks written instead of computed, cumulative
        # KV retention (loom/core/kv_retention.py): the engine's setting, each policy once, and the state of every
        # running request under a lossy policy (made at admission, dropped at preemption and finish)
        self.kv_retention: KVRetentionConfig = cache_config.kv_retention
        self.kv_retention_refused = kv_retention_refused
        self._retention_policies: dict[str, KVRetentionPolicy] = {}
        self._retention: dict[str, RetentionState] = {}

    # ---- admission -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or reject at once what can never run.

        Raises:
            ValueError: empty prompt (`prompt`); prompt too long for the model (`max_model_len`);
                more KV blocks needed than the whole pool (`num_kv_blocks`); duplicate `request_id`.
            QueueFullError: max_waiting_requests requests are already waiting beyond the free running seats
                (the n copies of one user request count once; see _queue_is_full).
        """
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if n > self.max_model_len or (request.max_tokens > 0 and n >= self.max_model_len):
            raise ValueError(
                f"prompt of {n} tokens does not fit max_model_len={self.max_model_len} "
                f"(with max_tokens={request.max_tokens})"
            )
        max_len = min(self.max_model_len, n + max(request.max_tokens, 1))
        blocks_needed = self._blocks_needed(max_len)
        if blocks_needed > self.num_blocks:
            raise ValueError(
                f"request needs {blocks_needed} KV blocks of {self.cache_config.block_size} tokens, "
                f"more than the whole pool (num_kv_blocks={self.num_blocks})"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.kv_retention = self._retention_config(request)
        if self._queue_is_full(request):
            raise QueueFullError(f"{len(self.waiting)} requests waiting (max_waiting_requests="
                                 f"{self.scheduler_config.max_waiting_requests}, all running seats taken)")
        request.status = RequestStatus.WAITING
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _retention_config(self, request: Request) -> KVRetentionConfig | None:
        """The request's KV retention: its sampling params' policy and budget over the engine's; None = full.

        Raises:
            ValueError: a lossy policy where the compacted block table cannot serve (a sliding-window or hybrid KV
                cache, speculative decoding, prefill/decode disaggregation, swap preemption, beam search).
        """
        params = request.sampling_params
        policy = params.kv_retention or self.kv_retention.policy
        if policy == "full":
            if params.kv_retention_budget is not None:
                raise ValueError("kv_retention_budget has no effect under kv_retention 'full': name a lossy "
                                 "kv_retention (sinks, h2o, snapkv) too")
            return None
        budget = params.kv_retention_budget if params.kv_retention_budget is not None else self.kv_retention.budget
        config = KVRetentionConfig(policy, budget, self.kv_retention.sink_tokens, self.kv_retention.window)
        conflicts = ((self.kv_retention_refused or "", self.kv_retention_refused is not None),
                     ("a sliding-window model", isinstance(self.kv_cache_manager, HybridKVCacheManager)
                      or getattr(self.kv_cache_manager, "sliding_window", None) is not None),
                     ("speculative decoding", self.proposer is not None),
                     ("kv_transfer_params", request.kv_transfer_id is not None or request.remote_kv is not None),
                     ("preemption_mode='swap'", self.scheduler_config.preemption_mode == "swap"),
                     ("beam search", request.beam_group is not None))
        for what, on in conflicts:
            if on:
                raise ValueError(f"kv_retention={policy!r} with {what} is not supported yet")
        return config

    def _retention_policy(self, name: str) -> KVRetentionPolicy:
        policy = self._retention_policies.get(name)
        if policy is None:
            policy = self._retention_policies[name] = get_retention_policy(name)
        return policy

    def _queue_is_full(self, request: Request) -> bool:
        """max_waiting_requests bounds the user requests that must wait for a seat: a request counts once
        however many copies (n) it has, and requests the next step will admit into free running seats
        (max_num_seqs - running) do not count, so a burst on an idle server is not refused."""
        limit = self.scheduler_config.max_waiting_requests
        if limit is None:
            return False
        groups = {r.group_id or r.request_id for r in self.waiting}
        if (request.group_id or request.request_id) in groups:
            return False  # a copy of a request already counted
        free_seats = max(0, self.scheduler_config.max_num_seqs - self.num_seats_used)
        return len(groups) >= limit + free_seats

    # ---- schedule --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens. Advances num_computed_tokens of every scheduled request.

        Returns:
            SchedulerOutput: running requests first (admission order), then newly admitted ones.
        """
        self.release_pinned_kv(time.monotonic())
        budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._share_seats(preempted)
        i = 0
        proposed = self._propose_all(budget)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or request.hold:
                i += 1
                continue
            branches = proposed.get(request.request_id, []) if num_new == 1 else []
            drafts, extra = self._fit_branches(request, branches, budget)
            if not drafts and not self._allocate_or_preempt(request, num_new, preempted):
                break  # it preempted itself; it was the last running request
            scheduled.append(self._schedule_one(request, num_new, is_new=False, drafts=drafts, branches=extra))
            budget -= num_new + len(drafts) + sum(len(tokens) + 1 for tokens, _ in extra)
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, preempted)
        total = self.scheduler_config.max_num_batched_tokens - budget
        copies = self.kv_cache_manager.take_step_copies()
        out = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            blocks_to_offload=copies.blocks_to_offload,
            blocks_to_restore=copies.blocks_to_restore,
            blocks_to_copy=self.kv_cache_manager.take_block_copies(),
            kv_loads=self._kv_loads,
        )
        self._finished_req_ids = []
        self._kv_loads = []
        return out

    def _fit_branches(self, request: Request, branches: list[list[int]],
                      budget: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """Fit a decoding request's candidate branches into what is left of the step's budget (the proposer
        was asked before the budget was spent) and the free blocks: branch 0's drafts, and the extra branches
        with their block tables. Branch 0 is verified in the request's own blocks (allocated for the longest
        branch, so that any branch's kept run can be moved there); each extra branch gets the request's full
        blocks before its first position and scratch blocks from there (the runner copies the partial
        block's earlier rows in). Speculation never preempts anyone: ([], []) when nothing fits."""
        if not branches or budget < 2:
            return [], []
        fitted = [branches[0][: budget - 1]]
        left = budget - 1 - len(fitted[0])
        for tokens in branches[1:]:
            if left < 2:
                break
            fitted.append(tokens[: left - 1])
            left -= len(fitted[-1]) + 1
        longest = max(len(t) for t in fitted)
        if self.kv_cache_manager.allocate_slots(request, 1 + longest) is None:
            return [], []
        bs = self.cache_config.block_size
        start = request.num_computed_tokens  # the position of the last token, the root of every branch
        table = self.kv_cache_manager.get_block_ids(request.request_id)
        extra: list[tuple[list[int], list[int]]] = []
        for tokens in fitted[1:]:
            first_block, last_block = start // bs, (start + len(tokens)) // bs
            scratch = self.kv_cache_manager.allocate_scratch(last_block - first_block + 1)
            if scratch is None:
                break
            extra.append((tokens, table[:first_block] + scratch))
        return fitted[0], extra

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Allocate for `request`, preempting from the back of running until it fits.

        Returns False when `request` itself had to be preempted.
        """
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self._pop_held() or self.running.pop()  # idle held beams go first
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _pop_held(self) -> Request | None:
        """Take the last held request (a beam waiting for its group) out of running, or None."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].hold:
                return self.running.pop(i)
        return None

    def _preempt(self, request: Request) -> None:
        # A held beam is recomputed, never swapped: its children are forked from it while it waits, and a
        # child of a waiting parent computes its prefix again (fork_request), so a host copy would go unused.
        swap = self.scheduler_config.preemption_mode == "swap" and not request.hold
        if not self.kv_cache_manager.preempt(request, swap):
            # Recomputed prompt positions produce their logprobs again; _new_prompt_logprobs drops them.
            self._prompt_logprobs_seen.pop(request.request_id, None)
        self._retention.pop(request.request_id, None)  # recomputed from the start, cut again
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # a swapped request gets its count back from the host tier
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        """Admit waiting requests: each time the first in the queue among those whose user request holds the
        fewest running seats (FIFO when every request is its own user request; held beams are passed over and
        keep their place). When it cannot get its blocks while held requests sit in running (beams waiting for
        a sibling, maybe this very request), held ones are preempted, last first, until it fits: otherwise a
        beam group whose held beams fill the pool would wait for ever for its last beam."""
        manager = self.kv_cache_manager
        seats = self._seats_by_user()
        while budget > 0:
            pick = self._next_to_admit(seats)
            if pick is None:
                break
            request = self.waiting[pick]
            if self.num_seats_used + request.num_seats > self.scheduler_config.max_num_seqs:
                break
            prefix, num_loaded = self._with_remote_kv(request, manager.find_computed_prefix(request))
            num_hit = prefix.num_tokens
            num_new = min(request.num_tokens - num_hit - num_loaded, budget)
            allocated = manager.allocate_slots(request, num_loaded + num_new, prefix.blocks, num_hit,
                                               prefix.restore_slots)
            while allocated is None and (victim := self._pop_held()) is not None:
                # idle while its group waits; held beams filling the pool would stall it. The victim, still
                # held, goes to the front of the queue, where admission passes it over.
                self._preempt(victim)
                pick += 1
                preempted.append(victim.request_id)
                seats[self._user_of(victim)] -= victim.num_seats
                # the victim's blocks may have been hits
                prefix, num_loaded = self._with_remote_kv(request, manager.find_computed_prefix(request))
                num_hit = prefix.num_tokens
                num_new = min(request.num_tokens - num_hit - num_loaded, budget)
                allocated = manager.allocate_slots(request, num_loaded + num_new, prefix.blocks, num_hit,
                                                   prefix.restore_slots)
            if allocated is None:
                break  # nothing overtakes the request whose turn it is
            del self.waiting[pick]
            if request.status == RequestStatus.WAITING:  # first admission, not a resumed preemption
                request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
            request.num_computed_tokens = num_hit
            if num_loaded:
                self._load_remote_kv(request, num_hit, num_loaded)
            request.remote_kv = None  # loaded or not needed: a later preemption recomputes
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats[self._user_of(request)] += request.num_seats
            scheduled.append(self._schedule_one(request, num_new, is_new=True))
            budget -= num_new
        return budget

    @staticmethod
    def _user_of(request: Request) -> str:
        """The user request a request belongs to: itself, or the request it is one of n copies of."""
        return request.group_id or request.request_id

    def _seats_by_user(self) -> Counter[str]:
        """Running seats held per user request."""
        seats: Counter[str] = Counter()
        for r in self.running:
            seats[self._user_of(r)] += r.num_seats
        return seats

    def _next_to_admit(self, seats: Counter[str]) -> int | None:
        """Index in the waiting queue of the first request (held ones passed over) whose user request holds the
        fewest running seats; None when every waiting request is held."""
        pick, fewest = None, 0
        for idx, r in enumerate(self.waiting):
            if r.hold:
                continue
            held = seats[self._user_of(r)]
            if pick is None or held < fewest:
                pick, fewest = idx, held
                if held == 0:
                    break
        return pick

    def _share_seats(self, preempted: list[str]) -> None:
        """Seats shared between user requests. A waiting user request that holds no running seat and finds
        none free takes one from the user request whose copies (n > 1) hold the most seats, when they hold more
        than an even share (max_num_seqs // user requests running or waiting, at least 1): that request's
        most recently admitted copy is preempted (recomputed or swapped as any preemption; its prompt blocks
        stay in the prefix cache while its siblings run) and admission's order (_next_to_admit) gives the seat
        to the waiting one in the next step. At most one copy per waiting user request, and only copies are
        taken: a single request keeps its seat, so without n > 1 this is FCFS as before. Without it, one
        request with n = 128 and a long max_tokens held every seat until its copies ended, and every request
        after it waited that long (vLLM and SGLang admit first come, first served)."""
        cap = self.scheduler_config.max_num_seqs
        seats = self._seats_by_user()
        starved: list[Request] = []
        seen: set[str] = set()
        for r in self.waiting:
            user = self._user_of(r)
            if r.hold or r.beam_group is not None or user in seen or seats[user] > 0:
                continue
            seen.add(user)
            starved.append(r)
        if not starved:
            return
        share = max(1, cap // (len(seats) + len(starved)))
        free = cap - self.num_seats_used
        for request in starved:
            if request.num_seats <= free:
                free -= request.num_seats  # a seat is free for it: admission gives it
                continue
            copies = [r for r in self.running if r.group_id is not None and r.beam_group is None and not r.hold]
            users = Counter(r.group_id for r in copies)
            if not users:
                return
            user, held = users.most_common(1)[0]
            if held <= share:
                return
            victim = next(r for r in reversed(self.running) if r in copies and r.group_id == user)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            self.num_fair_share_preemptions += 1

    def _with_remote_kv(self, request: Request, prefix: ComputedPrefix) -> tuple[ComputedPrefix, int]:
        """A disaggregated decode request's prefix: (what the cache serves, tokens to load from its pulled blocks).
        The pulled blocks cover a whole number of blocks after the device hits when they reach further than the
        cache (host-tier hits are then dropped: the pulled copy replaces them); (prefix, 0) otherwise."""
        remote = request.remote_kv
        if remote is None or remote.num_tokens <= prefix.num_tokens:
            return prefix, 0
        device_hit = len(prefix.blocks) * self.cache_config.block_size
        return ComputedPrefix(prefix.blocks, [], device_hit), remote.num_tokens - device_hit

    def _load_remote_kv(self, request: Request, num_hit: int, num_loaded: int) -> None:
        """Record the copies of the pulled blocks after the hits into the request's new blocks (run by the runner
        before this step's forward) and count them computed."""
        bs = self.cache_config.block_size
        first, count = num_hit // bs, num_loaded // bs
        table = self.kv_cache_manager.get_block_ids(request.request_id)
        self._kv_loads.append(KVBlockLoad(payload=request.remote_kv.payload,
                                          src_indices=list(range(first, first + count)),
                                          dst_block_ids=table[first : first + count]))
        request.num_computed_tokens = num_hit + num_loaded
        self.num_kv_blocks_loaded += count

    def _propose_all(self, budget: int) -> dict[str, list[list[int]]]:
        """request_id -> candidate draft runs (branch 0 first; one branch unless tree candidates are on and the
        request is greedy), for every running request that decodes one token this step, from one proposer
        call. Nothing while speculation is off (no proposer, or a batch of at least
        spec_disable_by_batch_size requests)."""
        limit = self.spec_disable_by_batch_size
        if self.proposer is None or (limit is not None and len(self.running) >= limit):
            return {}
        asks, wide = [], []
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1 or request.beam_group is not None:
                continue  # prefilling (no drafts yet), or a beam (its group takes one token per step)
            n = self._num_drafts(request, budget)
            if n > 0:
                ask = DraftRequest(request.request_id, request.token_ids_slice(0, request.num_tokens), n)
                # several branches are verified exactly only for greedy requests (the longest kept run
                # of any branch is the greedy output); a sampled one gets one branch, and so does a
                # structured-output one (its grammar masks follow one run of drafts)
                params = request.sampling_params
                tree = self.spec_tree_width > 1 and params.greedy and params.structured_output is None
                (wide if tree else asks).append(ask)
        out: dict[str, list[list[int]]] = {}
        if asks:
            for ask, d in zip(asks, self.proposer.propose_batch(asks), strict=True):
                d = self._grammar_prefix(ask.request_id, d[: ask.max_tokens])
                if d:
                    out[ask.request_id] = [d]
        if wide:
            for ask, branches in zip(wide, self.proposer.propose_branches(wide, self.spec_tree_width), strict=True):
                kept = [b[: ask.max_tokens] for b in branches[: self.spec_tree_width] if b]
                if kept:
                    out[ask.request_id] = kept
        return out

    def _grammar_prefix(self, request_id: str, drafts: list[int]) -> list[int]:
        """A structured-output request's drafts cut to the longest prefix its grammar accepts (all of them for
        another request; none without a draft_grammar)."""
        request = self.requests[request_id]
        spec = request.sampling_params.structured_output
        if spec is None or not drafts:
            return drafts
        if self.draft_grammar is None:
            return []
        return drafts[: self.draft_grammar.valid_draft_len(request_id, spec, request.output_token_ids, drafts)]

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Most drafts for a decoding request: k from its acceptance, within the step's budget, the request's
        max_tokens (the bonus token included) and max_model_len (every draft position gets a KV slot); 0
        while it backs off. Counts one back-off step."""
        wait = self._spec_backoff.get(request.request_id)
        if wait is not None and wait[0] > 0:
            self._spec_backoff[request.request_id] = (wait[0] - 1, wait[1])
            return 0
        return min(self._draft_limit(request.request_id), budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - len(request.output_token_ids) - 1)

    def _draft_limit(self, request_id: str) -> int:
        """k for this request: with per-token acceptance a, the kept run of drafts is geometric with mean
        a / (1 - a), so drafts past floor(a / (1 - a)) + 1 mostly buy verify rows for nothing; a request starts
        at the full k."""
        k = self.num_speculative_tokens
        stats = self._spec_accept.get(request_id)
        if stats is None or stats[1] <= 0:
            return k
        a = stats[0] / stats[1]
        if a >= 1.0:
            return k
        return max(1, min(k, int(a / (1.0 - a)) + 1))

    def _schedule_one(self, request: Request, num_new: int, is_new: bool, drafts: list[int] | None = None,
                      branches: list[tuple[list[int], list[int]]] | None = None) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        # The drafts' K/V are computed too; update_from_output moves num_computed_tokens back to the
        # tokens the request kept.
        request.spec_token_ids = drafts or []
        request.num_computed_tokens = end + len(request.spec_token_ids)
        num_dropped_tokens = score_rows = 0
        score_reduce = "sum"
        if request.kv_retention is not None:
            state = self._retention.get(request.request_id)
            if state is None:
                config = request.kv_retention
                state = self._retention[request.request_id] = RetentionState(
                    config, [], [], budget_tokens=config.budget_tokens(request.num_prompt_tokens))
            num_dropped_tokens = state.num_dropped_blocks * self.cache_config.block_size
            policy = self._retention_policy(state.config.policy)
            score_rows = policy.score_rows(state, start, end, request.num_tokens)
            score_reduce = policy.score_reduce
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end) + (drafts or []),
            start_position=start,
            block_table=self.kv_cache_manager.get_block_ids(request.request_id),
            sample=end == request.num_tokens and request.max_tokens > 0,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            is_new=is_new,
            spec_token_ids=drafts or [],
            spec_branches=branches or [],
            group_block_tables=self.kv_cache_manager.get_group_block_ids(request.request_id)
            if isinstance(self.kv_cache_manager, HybridKVCacheManager) else None,
            num_dropped_tokens=num_dropped_tokens,
            kv_score_rows=score_rows,
            kv_score_reduce=score_reduce,
        )

    def _blocks_needed(self, num_tokens: int) -> int:
        """Most blocks one request of num_tokens tokens holds at once: one per block_size tokens, or with a hybrid
        KV cache that per full-attention group plus, per sliding group, the blocks a step's chunk (up to
        max_num_batched_tokens) and the window before it span: cdiv(window + chunk, block_size) + 1."""
        bs = self.cache_config.block_size
        full = _cdiv(num_tokens, bs)
        if self.kv_group_windows is None:
            return full
        chunk = self.scheduler_config.max_num_batched_tokens
        return sum(full if w is None else min(full, _cdiv(w + chunk, bs) + 1) for w in self.kv_group_windows)

    def fork_request(self, parent: Request, child_id: str, last_token_id: int) -> Request:
        """Beam search: a new request that equals `parent` but for its last output token, which becomes
        `last_token_id` (that token's K/V is not computed yet, so the two share every computed position).

        A running parent's KV blocks are shared with the child by reference count (KVCacheManager.fork: the
        block both would write next is copied on write when the child is scheduled); a waiting one's child
        waits just before it and computes its prefix again (prefix-cache hits where they exist). The child takes
        one running seat and is not held.

        Raises:
            ValueError: the parent is not in the scheduler or has no output token; child_id is in use.
        """
        if self.requests.get(parent.request_id) is not parent or not parent.output_token_ids:
            raise ValueError(f"request {parent.request_id!r} cannot be forked (unknown or without output)")
        if child_id in self.requests:
            raise ValueError(f"request_id {child_id!r} is already in the engine")
        bs = self.cache_config.block_size
        running = parent.status == RequestStatus.RUNNING
        child = Request(
            request_id=child_id, prompt_token_ids=parent.prompt_token_ids, sampling_params=parent.sampling_params,
            eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time, max_tokens=parent.max_tokens,
            cache_salt=parent.cache_salt, group_id=parent.group_id, beam_group=parent.beam_group,
            output_token_ids=parent.output_token_ids[:-1] + [last_token_id],
            num_computed_tokens=parent.num_computed_tokens if running else 0,
            num_cached_tokens=parent.num_cached_tokens, status=parent.status,
            block_hashes=parent.block_hashes[: (parent.num_tokens - 1) // bs],
        )
        self.kv_cache_manager.update_block_hashes(child)
        self.requests[child_id] = child
        if running:
            self.kv_cache_manager.fork(parent.request_id, child_id)
            self.running.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent), child)
        return child

    # ---- update ----------------------------------------------------------------------------------

    def release_step_blocks(self) -> None:
        """Return the blocks lent for the last scheduled step only (tree candidates' scratch blocks): called by
        update_from_output, and by the engine when the step failed and no update follows."""
        self.kv_cache_manager.free_scratch()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stops, finish ended requests.

        Requests finished or aborted since `scheduler_output` was built are skipped.

        Returns:
            One EngineCoreOutput per request with news (new tokens, prompt logprobs, or finished).
        """
        self.release_step_blocks()
        outputs: list[EngineCoreOutput] = []
        for sched in scheduler_output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            out = self._update_one(request, sched, runner_output)
            if out is not None:
                outputs.append(out)
        return outputs

    def _update_one(
        self, request: Request, sched: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        rid = request.request_id
        new_token_ids: list[int] = []
        status: RequestStatus | None = None
        if sched.sample:
            sampled = runner_output.sampled_token_ids[rid]
            for token_id in sampled:
                request.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                status = check_stop(request, self.max_model_len)
                if status is not None:
                    break
            if sched.spec_token_ids:
                # Rejected drafts roll back: the K/V of the kept drafts are valid, the last kept token's
                # is computed next step (a rejected draft's slot is overwritten then; blocks past it stay
                # allocated and are reused). No block holding a rejected draft was hashed: hashes cover
                # known tokens only.
                request.num_computed_tokens = request.num_tokens - 1
                request.spec_token_ids = []
                kept = len(sampled) - 1
                branch = runner_output.spec_branch.get(rid, 0)
                drafted = len(sched.spec_token_ids if branch == 0 else sched.spec_branches[branch - 1][0])
                self.spec_stats.record(drafted, kept, 1 + len(sched.spec_branches), branch)
                accepted, trials = self._spec_accept.get(rid, (0.0, 0.0))
                rejected = 1 if kept < drafted else 0
                self._spec_accept[rid] = (SPEC_ACCEPT_DECAY * accepted + kept,
                                          SPEC_ACCEPT_DECAY * trials + kept + rejected)
                if kept:
                    self._spec_backoff.pop(rid, None)
                else:
                    backoff = min(2 * self._spec_backoff.get(rid, (0, 0))[1] or 1, SPEC_MAX_BACKOFF)
                    self._spec_backoff[rid] = (backoff, backoff)
            self.kv_cache_manager.update_block_hashes(request)
        elif request.max_tokens == 0 and request.num_computed_tokens >= request.num_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and rid in self._retention:
            self._apply_retention(request, self._retention[rid], runner_output.kv_block_scores.get(rid),
                                  sched.sample)
        logprobs = runner_output.logprobs.get(rid)
        if logprobs is not None:
            logprobs = logprobs[: len(new_token_ids)]
        prompt_logprobs = self._new_prompt_logprobs(rid, runner_output.prompt_logprobs.get(rid))
        kv_pinned = None
        if status is not None:
            kv_pinned = self._pin_for_transfer(request) if request.kv_transfer_id is not None else None
            if kv_pinned is None:
                self._finish(request, status)
            else:
                self._forget(request, status)
        if not new_token_ids and not prompt_logprobs and status is None:
            return None
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs or None,
            finish_reason=request.finish_reason.value if request.finish_reason is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            kv_pinned=kv_pinned,
        )

    def _apply_retention(self, request: Request, state: RetentionState, scores: list[float] | None,
                         sampled: bool) -> None:
        """After a step of a request under a lossy KV retention policy: bring its state up to its table (blocks
        appended since), add the step's attention scores, and, once a step reached its last known token and
        sampled (the prompt is computed exactly), drop the blocks the policy gives up."""
        manager = self.kv_cache_manager
        assert isinstance(manager, KVCacheManager)
        table_len = len(manager.req_to_blocks.get(request.request_id, []))
        while len(state.block_positions) < table_len:
            state.block_positions.append(state.block_positions[-1] + 1 if state.block_positions else 0)
            state.scores.append(0.0)
        if scores:
            for i, score in enumerate(scores[:table_len]):
                state.scores[i] += score
        bs = self.cache_config.block_size
        # the prompt (everything known at admission) is computed and the request decodes: the policy may cut
        caught_up = sampled and request.num_computed_tokens >= request.num_tokens - 1
        kept_tokens = request.num_computed_tokens - state.num_dropped_blocks * bs
        drops = self._retention_policy(state.config.policy).select_drops(state, kept_tokens, bs, caught_up)
        if not drops:
            return
        manager.drop_blocks(request.request_id, drops)
        gone = set(drops)
        state.block_positions = [p for i, p in enumerate(state.block_positions) if i not in gone]
        state.scores = [x for i, x in enumerate(state.scores) if i not in gone]
        state.num_dropped_blocks += len(drops)

    def _new_prompt_logprobs(self, request_id: str, entries: list[TokenLogprobs] | None) -> list[TokenLogprobs]:
        """Drop prompt logprobs already passed on before a preemption made the runner recompute them."""
        if not entries:
            return []
        seen = self._prompt_logprobs_seen.get(request_id, 0)
        sent = self._prompt_logprobs_sent.get(request_id, 0)
        self._prompt_logprobs_seen[request_id] = seen + len(entries)
        fresh = entries[max(0, sent - seen) :]
        self._prompt_logprobs_sent[request_id] = sent + len(fresh)
        return fresh

    # ---- finish ----------------------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort; a stop string found by the output processor).

        Unknown or already finished ids are ignored.

        Raises:
            ValueError: `status` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache_manager.free(request)
        self._forget(request, status)

    def _pin_for_transfer(self, request: Request) -> PinnedKV | None:
        """Keep a finished prefill-only request's prompt blocks for a decode replica (under its kv_transfer_id,
        until read, released or kv_transfer_timeout_s); None when they cannot be kept (a hybrid KV cache, or blocks
        the sliding window released): then they are freed as usual and the decode replica computes the prompt."""
        manager = self.kv_cache_manager
        if isinstance(manager, HybridKVCacheManager):
            return None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        num_blocks = _cdiv(num_tokens, self.cache_config.block_size)
        blocks = manager.req_to_blocks.get(request.request_id, [])[:num_blocks]
        if num_tokens < 1 or len(blocks) < num_blocks or any(b is None for b in blocks):
            return None
        if self.pinned_kv.num_blocks() + num_blocks > MAX_PINNED_FRACTION * self.num_blocks:
            # pins cannot be evicted: past this share of the pool, prefills of a flood (or of decode replicas
            # that never come) would stall admission until they expire; the decode replica computes instead
            return None
        transfer_id = request.kv_transfer_id
        assert transfer_id is not None
        holder = f"kv-transfer:{transfer_id}"
        manager.pin(request, holder)
        pinned = PinnedKV(transfer_id=transfer_id, block_ids=[b.block_id for b in blocks if b is not None],
                          num_tokens=num_tokens, prompt_digest=prompt_digest(request.prompt_token_ids[:num_tokens]))
        self.pinned_kv.pin(PinnedTransfer(transfer_id=transfer_id, owner=holder, block_ids=pinned.block_ids,
                                          num_tokens=num_tokens, prompt_digest=pinned.prompt_digest,
                                          deadline=time.monotonic() + self.pinned_kv.timeout_s))
        return pinned

    def release_pinned_kv(self, now: float) -> int:
        """Free the pinned transfers that were read, released, or expired by `now` (time.monotonic() seconds);
        returns how many. Called at every schedule() and by the engine's idle loop."""
        released = self.pinned_kv.take_released(now)
        for transfer in released:
            self.kv_cache_manager.free_holder(transfer.owner)
        return len(released)

    def _forget(self, request: Request, status: RequestStatus) -> None:
        """Take an ended request out of every queue and table (its blocks are freed or pinned by the caller)."""
        self._retention.pop(request.request_id, None)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        self._prompt_logprobs_sent.pop(request.request_id, None)
        self._prompt_logprobs_seen.pop(request.request_id, None)
        self._spec_backoff.pop(request.request_id, None)
        self._spec_accept.pop(request.request_id, None)
        if self.proposer is not None and request.beam_group is None:  # a beam's tokens are not an output
            self.proposer.request_finished(request.request_id, request.output_token_ids)
        self._finished_req_ids.append(request.request_id)

    @property
    def finished_request_ids(self) -> list[str]:
        """Requests that ended since the last schedule() (a copy)."""
        return list(self._finished_req_ids)

    # ---- stats -----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_seats_used(self) -> int:
        """Running seats taken (max_num_seqs bounds them): one per running request, a beam group's first
        request holds its whole width."""
        return sum(r.num_seats for r in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests, in [0, 1] (vllm:kv_cache_usage_perc)."""
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache, cumulative (vllm:prefix_cache_queries)."""
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens found in the prefix cache, cumulative (vllm:prefix_cache_hits)."""
        return self.kv_cache_manager.prefix_cache_hits

    @property
    def offload_counters(self) -> OffloadCounters:
        """Blocks offloaded to / restored from the host tier, and blocks recomputed after preemption."""
        return self.kv_cache_manager.offload_counters

    @property
    def num_window_blocks_freed(self) -> int:
        """Blocks released early because they fell out of the sliding window, cumulative."""
        return self.kv_cache_manager.num_window_blocks_freed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def check_invariants(self) -> None:
        """Assert the queues, the request table and the KV blocks agree."""
        self.kv_cache_manager.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
        assert not set(running_ids) & set(waiting_ids)
        assert set(running_ids) | set(waiting_ids) == set(self.requests)
        assert self.num_seats_used <= self.scheduler_config.max_num_seqs
        holders = set(self.kv_cache_manager.req_to_blocks)
        pinned = self.pinned_kv.owners()
        assert pinned <= holders, f"pinned transfers without blocks: {pinned - holders}"
        assert holders <= set(running_ids) | pinned, f"waiting requests hold blocks: {holders - set(running_ids)}"
        bs = self.cache_config.block_size
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert 0 < r.num_computed_tokens <= r.num_tokens_with_spec
            table = self.kv_cache_manager.get_block_ids(r.request_id)
            state = self._retention.get(r.request_id)
            dropped = state.num_dropped_blocks if state is not None else 0
            assert len(table) + dropped >= _cdiv(r.num_computed_tokens, bs)
            if dropped:
                assert isinstance(self.kv_cache_manager, KVCacheManager)
                assert self.kv_cache_manager.num_dropped_blocks.get(r.request_id) == dropped
                assert len(state.block_positions) <= len(table)
                assert all(a < b for a, b in zip(state.block_positions, state.block_positions[1:]))
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0


__all__ = ["Scheduler", "QueueFullError"]
