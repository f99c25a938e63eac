"""deploy/kubernetes: the router's flags parse with today's CLI, its --replica URLs are the StatefulSet's pod
names, and every container has a readiness probe on /health."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from loom.router.cli import add_router_args, router_config
from loom.server.cli import register as register_serve

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_every_container_is_ready_only_when_health_says_so() -> None:
    docs = _docs()
    workloads = [d for (kind, _), d in docs.items() if kind in ("Deployment", "StatefulSet")]
    assert len(workloads) == 2
    for doc in workloads:
        probe = _container(doc)["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] == "http"


def test_the_router_lists_every_replica_pod_and_its_flags_parse() -> None:
    docs = _docs()
    replicas = docs[("StatefulSet", "loom-replica")]
    service = docs[("Service", replicas["spec"]["serviceName"])]
    port = service["spec"]["ports"][0]["port"]
    expected = [f"http://loom-replica-{i}.{service['metadata']['name']}:{port}"
                for i in range(replicas["spec"]["replicas"])]
    command = _container(docs[("Deployment", "loom-router")])["command"]
    assert command[:3] == ["python", "-m", "loom.router"]
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    ns = parser.parse_args(command[3:])
    assert ns.replica == expected
    router_config(ns)  # raises on a bad value
    serve_command = _container(replicas)["command"]
    assert serve_command[:2] == ["loom", "serve"]
    top = argparse.ArgumentParser()
    register_serve(top.add_subparsers())
    serve_ns = top.parse_args(serve_command[1:])
    assert serve_ns.port == port and serve_ns.host == "0.0.0.0"
