"""`loom router`: run the router over replicas given by URL, or started here (`--replicas N -- SERVE ARGS`)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import httpx
import uvicorn

from loom.router.app import build_router_app
from loom.router.router import Router, RouterConfig
from loom.router.policy import POLICIES, PolicyOptions
from loom.router.replica import ReplicaSet
from loom.server.header_timeout import http_protocol
from loom.server.security import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES, SecurityConfig

logger = logging.getLogger(__name__)

_DEFAULT_OPTIONS = PolicyOptions()
BUILTIN_POLICIES = ("round_robin", "least_load", "cache_aware")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `router` subcommand to the loom CLI."""
    p = subparsers.add_parser("router", help="an OpenAI-compatible router over replicas of loom serve",
                              description=_DESCRIPTION)
    add_router_args(p)


_DESCRIPTION = ("Route OpenAI requests over replicas of `loom serve` (docs/fleet.md). Give replicas by URL "
                "(--replica, repeatable), or start N here: `loom router --replicas 2 -- --num-threads 1` passes "
                "everything after -- to each `loom serve`.")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The router's flags."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    p.add_argument("--prefill-replica", action="append", default=[], metavar="URL",
                   help="prefill/decode disaggregation: a `loom serve --kv-transfer-role producer` replica that "
                   "prefills each request; the --replica ones (consumers) pull its KV and decode (repeatable; "
                   "docs/disaggregation.md)")
    p.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="start N local `loom serve` replicas with the arguments after -- (default: none)")
    p.add_argument("--replica-base-port", type=int, default=None, metavar="PORT",
                   help="ports of the local replicas: PORT, PORT+1, ... (default: --port + 1 onwards)")
    p.add_argument("--policy", default="cache_aware", metavar="NAME",
                   help="replica policy: " + ", ".join(BUILTIN_POLICIES) + " (default: %(default)s)")
    p.add_argument("--cache-threshold", type=float, default=_DEFAULT_OPTIONS.cache_threshold,
                   help="cache_aware: route by prefix when it covers at least this fraction of the prompt "
                   "(default: %(default)s)")
    p.add_argument("--balance-abs-threshold", type=int, default=_DEFAULT_OPTIONS.balance_abs_threshold,
                   help="cache_aware: least load instead when max - min load exceeds this (default: %(default)s)")
    p.add_argument("--balance-rel-threshold", type=float, default=_DEFAULT_OPTIONS.balance_rel_threshold,
                   help="... and max load exceeds this x min load (default: %(default)s)")
    p.add_argument("--model-selector", default=None, metavar="NAME",
                   help="choose the model for requests naming --routing-alias (e.g. difficulty; default: none)")
    p.add_argument("--model-selector-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the model selector (repeatable)")
    p.add_argument("--routing-alias", default="auto", help="model name that asks the selector (default: %(default)s)")
    p.add_argument("--health-interval", dest="health_interval_s", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between health checks (default: %(default)s)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="replicas a request may be tried on before it fails (default: %(default)s)")
    p.add_argument("--upstream-timeout", dest="upstream_timeout_s", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a replica may stay silent mid-response before the router cuts it "
                   "(default: %(default)s)")
    p.add_argument("--result-cache-size", type=int, default=0, metavar="N",
                   help="keep the whole responses of N deterministic requests at the router (greedy or seeded; "
                   "keyed by model identity, tenant and the whole body; docs/fleet.md) (default: 0 = off)")
    p.add_argument("--result-cache-ttl", dest="result_cache_ttl_s", type=float, default=600.0, metavar="SECONDS",
                   help="lifetime of a result-cache entry (default: %(default)s)")
    p.add_argument("--result-cache-max-bytes", type=int, default=256 << 20,
                   help="bytes the result cache may hold (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} when set, else no key); "
                   "the header is passed on to the replicas")
    p.add_argument("--replica-api-key", default=None,
                   help="bearer token of the replicas, sent on the router's own health checks (default: --api-key)")
    p.add_argument("--admin-api-key", default=None,
                   help="bearer token of the /router/* admin routes (default: none, and then they answer only "
                   "clients on this machine)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted, bytes (default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: %(default)s)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: the arguments of each local `loom serve` (with --replicas)")
    p.set_defaults(func=run_router)


def _selector_options(pairs: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"model_selector_option must be KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """RouterConfig from the parsed flags. Raises ValueError naming the bad option."""
    if ns.policy not in BUILTIN_POLICIES and ns.policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(BUILTIN_POLICIES)}, got {ns.policy!r}")
    if ns.model_selector_option and not ns.model_selector:
        raise ValueError("model_selector_option: give the selector they are for with --model-selector")
    options = PolicyOptions(cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
                            balance_rel_threshold=ns.balance_rel_threshold)
    # the flags' dests are RouterConfig's field names, so loom.cli names the flag in RouterConfig's errors
    return RouterConfig(policy=ns.policy, policy_options=options, model_selector=ns.model_selector,
                        model_selector_options=_selector_options(ns.model_selector_option),
                        routing_alias=ns.routing_alias, health_interval_s=ns.health_interval_s,
                        max_attempts=ns.max_attempts, upstream_timeout_s=ns.upstream_timeout_s,
                        result_cache_size=ns.result_cache_size, result_cache_ttl_s=ns.result_cache_ttl_s,
                        result_cache_max_bytes=ns.result_cache_max_bytes)


def check_listen_address(host: str, port: int) -> None:
    """Raise ValueError naming `port` when it is taken on `host`, or `host` when it cannot be listened on."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port: {host}:{port} is taken") from None
            raise ValueError(f"host: cannot listen on {host}:{port}: {e.strerror}") from None


def start_local_replicas(n: int, base_port: int, serve_args: list[str]) -> list[subprocess.Popen[bytes]]:
    """Start `n` `loom serve` processes on 127.0.0.1:base_port.. with `serve_args`. Raises ValueError when a port
    is taken or the args set --host/--port themselves."""
    if any(a in ("--port", "--host") or a.startswith(("--port=", "--host=")) for a in serve_args):
        raise ValueError("serve_args: --host and --port of local replicas are set by the router "
                         "(--replica-base-port)")
    for i in range(n):
        try:
            check_listen_address("127.0.0.1", base_port + i)
        except ValueError as e:
            raise ValueError(f"replica_base_port: {e}") from None
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "loom.cli", "serve", "--host", "127.0.0.1", "--port", str(base_port + i),
               *serve_args]
        procs.append(subprocess.Popen(cmd, start_new_session=True, cwd=str(Path.cwd())))
    return procs


def wait_until_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Block until every URL answers /health 200. Raises RuntimeError if a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a local replica exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(pending[0] + "/health", timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {pending[0]} was not ready within {timeout_s:.0f} s")
        time.sleep(0.25)


def run_router(ns: argparse.Namespace) -> int:
    """Run the router until a signal; stop the local replicas it started. Returns the exit code."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per health check otherwise
    if ns.replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {ns.replicas}")
    serve_args = list(ns.serve_args)
    if serve_args and serve_args[0] == "--":
        serve_args = serve_args[1:]
    if serve_args and not ns.replicas:
        raise ValueError("serve_args: arguments after -- are for local replicas; give --replicas N")
    if not ns.replicas and not ns.replica:
        raise ValueError("replica: give replica URLs with --replica URL, or start local ones with --replicas N")
    config = router_config(ns)
    api_key = ns.api_key if ns.api_key is not None else os.environ.get(API_KEY_ENV) or None
    security = SecurityConfig(api_key=api_key, max_request_bytes=ns.max_request_bytes)
    urls = list(ns.replica)
    replica_key = ns.replica_api_key if ns.replica_api_key is not None else api_key
    replicas = ReplicaSet(urls, api_key=replica_key)  # checks the URLs before anything starts
    prefill_replicas = ReplicaSet(list(ns.prefill_replica), api_key=replica_key)
    check_listen_address(ns.host, ns.port)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if ns.replicas:
            base = ns.replica_base_port if ns.replica_base_port is not None else ns.port + 1
            procs = start_local_replicas(ns.replicas, base, serve_args)
            local = [f"http://127.0.0.1:{base + i}" for i in range(ns.replicas)]
            logger.info("starting %d local replicas on ports %d..%d", ns.replicas, base, base + ns.replicas - 1)
            try:
                wait_until_healthy(local, procs, timeout_s=600.0)
            except RuntimeError as e:  # most often a bad argument after --: its own error is printed above
                raise ValueError(f"serve_args: {e}") from None
            for url in local:
                replicas.add(url)
        router = Router(replicas, config, prefill_replicas)
        app = build_router_app(router, security, admin_api_key=ns.admin_api_key)
        logger.info("routing on http://%s:%d over %d replicas (policy %s)", ns.host, ns.port, len(replicas),
                    config.policy)
        uv = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, lifespan="on",
                            timeout_graceful_shutdown=5, http=http_protocol(60.0))
        _run_until_sigterm(uvicorn.Server(uv))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        logger.info("router stopped")
    return 0


class _Terminated(Exception):
    """SIGTERM arrived: unwind so the local replicas are stopped."""


def _raise_terminated(sig: int, frame: FrameType | None) -> None:
    raise _Terminated()


def _run_until_sigterm(server: uvicorn.Server) -> None:
    """server.run(), returning normally on SIGTERM too. uvicorn handles SIGTERM itself, then re-raises it once it
    has shut down; with the default handler that would kill this process before its `finally` stops the local
    replicas (systemd and Kubernetes stop processes with SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run()
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """`python -m loom.router ...`: the router without importing the engine (or torch)."""
    parser = argparse.ArgumentParser(prog="python -m loom.router", description=_DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    add_router_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns))
    except ValueError as exc:
        parser.exit(2, f"loom router: error: {exc}\n")


__all__ = ["main", "register", "router_config", "run_router", "start_local_replicas"]
