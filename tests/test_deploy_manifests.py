"""deploy/kubernetes/tokenwire.yaml is on paper (no cluster here), but it must agree with the
product: the pod's arguments parse as `tokenwire launch` flags, the probes and ports are the
ones those flags open, the termination grace covers preStop + drain, and GIE's endpoint picker
is told the metric names the router exposes (the ones tokenwire's own picker reads)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from service.app.launcher import add_arguments
from service.observability import adapter_load
from service.picker.replicas import MetricNames

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "tokenwire.yaml"


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--"))


def test_tokenwire_pod_agrees_with_the_launcher_flags() -> None:
    docs = documents()
    pod = docs[("Deployment", "tokenwire")]
    c = container(pod)
    assert c["args"][0] == "launch"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    launch = parser.parse_args(c["args"][1:])  # every argument is a `tokenwire launch` flag
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": launch.http_port, "grpc": launch.port, "metrics": 9000}
    assert int(launch.prometheus_port) == ports["metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == launch.port  # the router's grpc.health.v1
    # Liveness must not kill a draining pod: its failure window exceeds the drain.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > float(launch.graceful_timeout)
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(sleep[1]) + float(launch.graceful_timeout) + 5
    pool = docs[("InferencePool", "tokenwire")]["spec"]
    assert pool["selector"]["matchLabels"] == pod["spec"]["selector"]["matchLabels"]
    assert [p["number"] for p in pool["targetPorts"]] == [launch.http_port]


def test_endpoint_picker_reads_the_metric_names_the_router_exposes() -> None:
    docs = documents()
    epp = flags(container(docs[("Deployment", "tokenwire-epp")])["args"])
    names = MetricNames()
    assert epp["total-queued-requests-metric"] == names.waiting
    assert epp["total-running-requests-metric"] == names.running
    assert epp["kv-cache-usage-percentage-metric"] == names.kv_usage
    assert epp["cache-info-metric"] == names.cache_info
    assert epp["lora-info-metric"] == adapter_load.METRIC
    pod = flags(container(docs[("Deployment", "tokenwire")])["args"])
    assert epp["model-server-metrics-port"] == pod["prometheus-port"]
    pool = docs[("InferencePool", "tokenwire")]["spec"]
    assert pool["endpointPickerRef"]["port"]["number"] == int(epp["grpc-port"])
    assert pool["endpointPickerRef"]["name"] == "tokenwire-epp"
