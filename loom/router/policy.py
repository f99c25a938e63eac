"""The router's two choices per request, each behind a small Protocol and a registry.

1. Which model serves it (`ModelSelector`): the model the client named, or, for a routing alias such as
   `auto`, a choice by difficulty and length among the models the fleet serves (loom/router/difficulty.py).
2. Which replica of that model serves it (`RoutingPolicy`): round robin, least load, cache aware
   (loom/router/policies.py). The router first filters the replicas to those that can serve the request
   (healthy, not draining, serving the model); a policy only ranks what is left.

Both are torch-free: the router is a small process in front of the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at in one incoming request (read-only)."""

    path: str  # the OpenAI route, e.g. "/v1/chat/completions"
    model: str | None  # the body's "model" (None: the client named none)
    text: str  # the prompt as text (a completion's prompt, or the chat messages' contents joined in order)
    body: dict[str, Any]  # the parsed JSON body, as the client sent it
    tenant: str = ""  # who asks: result_cache.tenant_of(Authorization header, cache_salt), a sha256 hex digest


@dataclass(slots=True)
class ReplicaState:
    """What the router knows about one replica: its identity from /v1/models, its load from /load."""

    url: str  # base URL, e.g. "http://127.0.0.1:8001"
    models: tuple[str, ...] = ()  # model ids it serves (from /v1/models)
    identity: str = ""  # the model's identity hash (weights, quantization, tokenizer), "" when unknown
    healthy: bool = False  # the last health check passed
    draining: bool = False  # takes no new requests (rolling upgrade); finishes those it has
    num_running: int = 0  # requests holding KV blocks (from the replica's /load)
    num_waiting: int = 0  # requests queued at the replica (from /load)
    kv_cache_usage: float = 0.0  # fraction of its KV blocks in use, 0..1 (from /load)
    prefix_cache_queries: int = 0  # cumulative prompt tokens the replica looked up in its prefix cache (/load)
    prefix_cache_hits: int = 0  # cumulative prompt tokens it found there (/load)
    kv_transfer_role: str | None = None  # producer | consumer | both (from /load); None: no disaggregation
    in_flight: int = 0  # requests this router has sent there and not seen finish
    failures: int = 0  # consecutive failed health checks or connections

    @property
    def load(self) -> int:
        """Requests at the replica as the router sees it: the larger of its own count and the router's."""
        return max(self.in_flight, self.num_running + self.num_waiting)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """A policy's choice and why (the reason is a metric label)."""

    replica: ReplicaState  # where the request goes
    reason: str  # e.g. "round_robin", "least_load", "prefix_match", "balance", "smallest_tree"
    matched_chars: int = 0  # cache aware: characters of the prompt the replica probably has cached


class RoutingPolicy(Protocol):
    """Ranks the replicas that can serve a request; the router sends it to the first."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaState]) -> RouteDecision:
        """Where to send `request`; `candidates` is non-empty and every one can serve it."""
        ...

    def on_routed(self, request: RouteRequest, replica: ReplicaState) -> None:
        """Told after the request went to `replica` (a cache-aware policy remembers the prefix)."""
        ...

    def on_removed(self, replica_url: str) -> None:
        """Told when a replica leaves the fleet (forget what was known of it)."""
        ...


class ModelSelector(Protocol):
    """Picks the model for a request that names a routing alias (e.g. "auto")."""

    name: str

    def select(self, request: RouteRequest, models: Sequence[str]) -> str:
        """One of `models` (non-empty: the models some healthy replica serves)."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Options of the replica policies (SGLang's router uses the same knobs and defaults)."""

    cache_threshold: float = 0.5  # cache aware: route by prefix when the best match covers >= this of the text
    balance_abs_threshold: int = 32  # cache aware: fall back to least load when max load - min load > this
    balance_rel_threshold: float = 1.5  # ... and max load > this x min load
    max_tree_chars: int = 1 << 22  # cache aware: characters remembered per replica before LRU eviction
    max_prefix_chars: int = 1 << 16  # cache aware: characters of a prompt matched and remembered (its start)
    extra: dict[str, Any] = field(default_factory=dict)  # options of policies registered elsewhere

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_prefix_chars < 1:
            raise ValueError(f"max_prefix_chars must be >= 1, got {self.max_prefix_chars}")
        if self.max_tree_chars < 1:
            raise ValueError(f"max_tree_chars must be >= 1, got {self.max_tree_chars}")


POLICIES: dict[str, Callable[[PolicyOptions], RoutingPolicy]] = {}
MODEL_SELECTORS: dict[str, Callable[[dict[str, Any]], ModelSelector]] = {}


def register_policy(name: str, factory: Callable[[PolicyOptions], RoutingPolicy]) -> None:
    """Add a replica policy to the registry (`loom router --policy NAME`)."""
    POLICIES[name] = factory


def make_policy(name: str, options: PolicyOptions | None = None) -> RoutingPolicy:
    """The replica policy called `name`. Raises ValueError (naming `policy`) for an unknown name."""
    import loom.router.policies  # noqa: F401  (registers the built-in policies)

    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](options or PolicyOptions())


def register_model_selector(name: str, factory: Callable[[dict[str, Any]], ModelSelector]) -> None:
    """Add a model selector to the registry (`loom router --model-selector NAME`)."""
    MODEL_SELECTORS[name] = factory


def make_model_selector(name: str, options: dict[str, Any] | None = None) -> ModelSelector:
    """The model selector called `name`. Raises ValueError (naming `model_selector`) for an unknown name."""
    import loom.router.difficulty  # noqa: F401  (registers the difficulty and length selectors)
    if name not in MODEL_SELECTORS:
        raise ValueError(f"model_selector must be one of {sorted(MODEL_SELECTORS)}, got {name!r}")
    return MODEL_SELECTORS[name](dict(options or {}))


__all__ = ["MODEL_SELECTORS", "POLICIES", "ModelSelector", "PolicyOptions", "ReplicaState", "RouteDecision",
           "RouteRequest", "RoutingPolicy", "make_model_selector", "make_policy", "register_model_selector",
           "register_policy"]
