"""The replicas behind the router: their URLs, health, models and load, refreshed by a background check.

Each check reads three routes of `loom serve`: /health (up?), /v1/models (which model ids, and the model's
identity hash when the replica reports one) and /load (queue, running batch, KV cache usage). A replica whose
check fails `max_failures` times in a row is unhealthy and gets no requests until a check passes again; a
draining replica gets no new requests but finishes those it has (a rolling upgrade drains the old version).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx

from loom.router.policy import ReplicaState

logger = logging.getLogger(__name__)


def check_replica_url(url: str) -> str:
    """`url` without a trailing slash. Raises ValueError (naming `replica`) unless it is http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica must be an http(s) URL such as http://127.0.0.1:8001, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"replica: a URL must not carry a query or fragment, got {url!r}")
    try:
        parts.port  # noqa: B018 (urllib checks the port's range when it is read)
    except ValueError:
        raise ValueError(f"replica: the port must be in [0, 65535], got {url!r}") from None
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"replica: give the server's base URL, without /v1 (the router adds the routes), "
                         f"got {url!r}")
    return url.rstrip("/")


class ReplicaSet:
    """The fleet as the router sees it. Mutated only on the router's event loop (no locks needed)."""

    def __init__(self, urls: list[str], max_failures: int = 2, api_key: str | None = None) -> None:
        """`api_key`: sent as a bearer token on the health checks (replicas started with --api-key answer
        /v1/models and /load only with it)."""
        if max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {max_failures}")
        self.max_failures = max_failures
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._replicas: dict[str, ReplicaState] = {}
        for url in urls:
            self.add(url)

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, url: str) -> ReplicaState | None:
        return self._replicas.get(check_replica_url(url))

    def add(self, url: str) -> ReplicaState:
        """Add a replica (unhealthy until its first check passes). Raises ValueError for a bad or known URL."""
        url = check_replica_url(url)
        if url in self._replicas:
            raise ValueError(f"replica {url} is already in the fleet")
        state = self._replicas[url] = ReplicaState(url)
        return state

    def remove(self, url: str) -> ReplicaState:
        """Take a replica out of the fleet. Raises ValueError for an unknown URL."""
        state = self._replicas.pop(check_replica_url(url), None)
        if state is None:
            raise ValueError(f"replica {url} is not in the fleet")
        return state

    def models(self) -> list[str]:
        """Model ids served by at least one healthy replica that is not draining, sorted."""
        return sorted({m for r in self._replicas.values() if r.healthy and not r.draining for m in r.models})

    def known_models(self) -> set[str]:
        """Model ids any replica has reported, healthy or not."""
        return {m for r in self._replicas.values() for m in r.models}

    def eligible(self, model: str | None, exclude: frozenset[str] | set[str] = frozenset(),
                 version: str = "") -> list[ReplicaState]:
        """Healthy, not draining replicas serving `model` (any model when None) whose model identity digest
        starts with `version` ("" = any version), minus the URLs in `exclude`."""
        return [r for r in self._replicas.values()
                if r.healthy and not r.draining and r.url not in exclude and (model is None or model in r.models)
                and r.identity.startswith(version)]

    def mark_failed(self, replica: ReplicaState) -> None:
        """A connection to the replica failed: count it, and stop routing there after `max_failures`."""
        replica.failures += 1
        if replica.failures >= self.max_failures and replica.healthy:
            replica.healthy = False
            logger.warning("replica %s marked unhealthy after %d failures", replica.url, replica.failures)

    async def check(self, client: httpx.AsyncClient, replica: ReplicaState, timeout_s: float) -> None:
        """One health check of one replica (updates it in place; never raises)."""
        try:
            health = await client.get(f"{replica.url}/health", timeout=timeout_s, headers=self._headers)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
            models = await client.get(f"{replica.url}/v1/models", timeout=timeout_s, headers=self._headers)
            if models.status_code != 200:
                raise RuntimeError(f"/v1/models answered {models.status_code}"
                                   + (" (a replica with --api-key: give the router --replica-api-key)"
                                      if models.status_code == 401 else ""))
            cards = models.json()["data"]
            replica.models = tuple(str(c["id"]) for c in cards)
            replica.identity = _identity_digest(cards)
            load = await client.get(f"{replica.url}/load", timeout=timeout_s, headers=self._headers)
            if load.status_code == 200:
                _apply_load(replica, load.json())
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy now"
            if replica.healthy or replica.failures == 0:
                logger.warning("health check of %s failed: %s", replica.url, e)
            replica.failures += 1
            if replica.failures >= self.max_failures:
                replica.healthy = False
            return
        if not replica.healthy:
            logger.info("replica %s is healthy (models: %s)", replica.url, ", ".join(replica.models))
        replica.healthy = True
        replica.failures = 0

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Check every replica concurrently."""
        await asyncio.gather(*(self.check(client, r, timeout_s) for r in self))


def _identity_digest(cards: list[dict[str, Any]]) -> str:
    """The served model's identity digest from its /v1/models card ("" when the replica reports none)."""
    for card in cards:
        identity = card.get("loom_model_identity")
        if isinstance(identity, dict) and identity.get("digest"):
            return str(identity["digest"])
    return ""


def _apply_load(replica: ReplicaState, load: dict[str, Any]) -> None:
    replica.num_running = int(load.get("num_requests_running", 0))
    replica.num_waiting = int(load.get("num_requests_waiting", 0))
    replica.kv_cache_usage = float(load.get("kv_cache_usage", 0.0))
    replica.prefix_cache_queries = int(load.get("prefix_cache_queries", 0))
    replica.prefix_cache_hits = int(load.get("prefix_cache_hits", 0))
    role = load.get("kv_transfer_role")
    replica.kv_transfer_role = role if isinstance(role, str) else None


__all__ = ["ReplicaSet", "check_replica_url"]
