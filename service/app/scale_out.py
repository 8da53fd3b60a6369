"""Envoy in front of many replicas: the parts of the gateway config that `tokenwire gateway`
(and `tokenwire launch --replicas N`) add to envoy/envoy.yaml.

- Backends: the router cluster lists every replica, with active gRPC health checks (a replica
  answering NOT_SERVING, i.e. warming up, draining or after a shard failure, is taken out within
  about `unhealthy_threshold` x `health_interval_s`), outlier detection (consecutive 5xx / gateway
  failures, gRPC statuses counted through Envoy's gRPC-to-HTTP mapping) and no panic routing
  (unhealthy replicas never get requests; with none healthy, Envoy answers 503 at once).
- Retries: a request that failed before any response byte is sent again to another replica:
  connection refused, refused stream, reset before the response started, gRPC UNAVAILABLE
  (draining, shard failure), and the OpenAI routes' 503 (their errors are HttpBody answers whose
  status travels in `x-tokenwire-http-status`). Once a response started nothing is retried.
  Retries outstanding may be as many as requests (envoy.yaml's single-router config allows 3,
  Envoy's default): a replica that fails with many requests queued fails them all at once, and
  each must go to another replica rather than end with UNAVAILABLE as a retry "overflow".
- Balancing: Envoy's least-request (or round-robin), or with a picker the `override_host` load
  balancing policy reading `x-gateway-destination-endpoint` / dynamic metadata `envoy.lb`
  (GIE's endpoint-picker protocol), with least-request as its fallback, and the ext_proc filter
  calling the picker (request headers and buffered body; responses untouched; a picker failure
  or timeout falls back to least-request).
- Tracing: Envoy's OpenTelemetry tracer exporting OTLP/gRPC, W3C traceparent honoured and
  propagated to the routers.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

ROUTER_CLUSTER = "tokenwire_router"
PICKER_CLUSTER = "tokenwire_picker"
OTLP_CLUSTER = "tokenwire_otlp"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
ROUTER_FILTER = "envoy.filters.http.router"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
OPENAI_STATUS_HEADER = "x-tokenwire-http-status"
_HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


@dataclass(frozen=True)
class ScaleOut:
    """Replicas behind one Envoy and how requests reach them."""

    backends: tuple[Endpoint, ...]
    picker: Endpoint | None = None  # the endpoint picker's ext_proc server; None: Envoy balances
    lb_policy: str = "least_request"  # "least_request" | "round_robin" (also the picker's fallback)
    health_interval_s: float = 1.0
    unhealthy_threshold: int = 2
    num_retries: int = 2
    picker_timeout_s: float = 1.0


@dataclass(frozen=True)
class EnvoyTracing:
    """Where Envoy sends its spans (an OTLP/gRPC collector) and under which service name."""

    collector: Endpoint
    service_name: str


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _socket(e: Endpoint) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": e.host, "port_value": e.port}}}


def _policy(name: str) -> dict[str, Any]:
    types = {
        "least_request": "least_request.v3.LeastRequest",
        "round_robin": "round_robin.v3.RoundRobin",
    }
    if name not in types:
        raise ValueError(f"lb policy must be one of {sorted(types)}, not {name!r}")
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": f"envoy.load_balancing_policies.{name}",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                        + types[name]
                    },
                }
            }
        ]
    }


def _override_host(fallback: str) -> dict[str, Any]:
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                        "override_host.v3.OverrideHost",
                        "override_host_sources": [
                            {"header": DESTINATION_HEADER},
                            {
                                "metadata": {
                                    "key": "envoy.lb",
                                    "path": [{"key": DESTINATION_HEADER}],
                                }
                            },
                        ],
                        "fallback_policy": _policy(fallback),
                    },
                }
            }
        ]
    }


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == name:
            return cluster
    raise KeyError(name)


def _grpc_route(hcm: dict[str, Any]) -> dict[str, Any]:
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if route["match"].get("grpc") is not None:
            return route
    raise KeyError("grpc route")


def apply_scale_out(config: dict[str, Any], scale: ScaleOut) -> None:
    """Points the router cluster at every replica and adds health, retries, balancing, picker."""
    cluster = _cluster(config, ROUTER_CLUSTER)
    cluster["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": _socket(b)} for b in scale.backends]}
    ]
    if all(_is_ip(b.host) for b in scale.backends):
        # Addresses need no resolving. With STRICT_DNS (envoy.yaml's, for host names) Envoy
        # routed to only two of three loopback replicas for the first seconds after all three
        # passed their health checks; a STATIC cluster routes to each as soon as it passes.
        cluster["type"] = "STATIC"
    interval = f"{scale.health_interval_s:g}s"
    cluster["health_checks"] = [
        {
            "timeout": "1s",
            "interval": interval,
            "no_traffic_interval": interval,
            "unhealthy_threshold": scale.unhealthy_threshold,
            "healthy_threshold": 1,
            "grpc_health_check": {},
        }
    ]
    cluster["outlier_detection"] = {
        "consecutive_5xx": 5,
        "consecutive_gateway_failure": 3,
        "interval": "1s",
        "base_ejection_time": "10s",
        "max_ejection_percent": 50,
    }
    # A retry holds a max_retries slot from the failure until the next attempt's answer starts
    # (back-off, then a prefill elsewhere): with 3, a dying replica failing 7 queued requests at
    # once sent 4 of them back to their clients as UNAVAILABLE. num_retries bounds each request.
    for threshold in cluster.setdefault("circuit_breakers", {}).setdefault("thresholds", [{}]):
        threshold["max_retries"] = threshold.get("max_requests", 1024)
    # No panic routing: an unhealthy replica gets nothing, even when most are unhealthy.
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}
    cluster.pop("lb_policy", None)
    cluster["load_balancing_policy"] = (
        _override_host(scale.lb_policy) if scale.picker is not None else _policy(scale.lb_policy)
    )
    hcm = _hcm(config)
    route = _grpc_route(hcm)
    route["route"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,reset,unavailable,retriable-headers",
        "num_retries": scale.num_retries,
        "retriable_headers": [{"name": OPENAI_STATUS_HEADER, "string_match": {"exact": "503"}}],
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                    "PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
        "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.5s"},
    }
    if scale.picker is not None:
        _add_picker(config, hcm, scale)


def _add_picker(config: dict[str, Any], hcm: dict[str, Any], scale: ScaleOut) -> None:
    assert scale.picker is not None
    config["static_resources"]["clusters"].append(
        {
            "name": PICKER_CLUSTER,
            "type": "STRICT_DNS",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": _HTTP2,
            "load_assignment": {
                "cluster_name": PICKER_CLUSTER,
                "endpoints": [{"lb_endpoints": [{"endpoint": _socket(scale.picker)}]}],
            },
        }
    )
    ext_proc = {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": PICKER_CLUSTER},
                "timeout": f"{scale.picker_timeout_s:g}s",
            },
            # A picker that fails or is slow must not fail requests: least-request takes over.
            "failure_mode_allow": True,
            "message_timeout": f"{scale.picker_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "BUFFERED",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
            "mutation_rules": {"allow_all_routing": True},
        },
    }
    filters = hcm["http_filters"]
    # After the transcoder (the picker reads gRPC messages), right before the router.
    at = next(i for i, f in enumerate(filters) if f["name"] == ROUTER_FILTER)
    filters.insert(at, ext_proc)
    # Server reflection is a bidirectional stream: a buffered body would never end. It needs no
    # picking (any replica answers the same).
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    grpc_route = _grpc_route(hcm)
    reflection = {
        "match": {"prefix": "/grpc.reflection.", "grpc": {}},
        "route": dict(grpc_route["route"]),
        "typed_per_filter_config": {
            **grpc_route.get("typed_per_filter_config", {}),
            EXT_PROC_FILTER: {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True,
            },
        },
    }
    routes.insert(routes.index(grpc_route), reflection)


def apply_tracing(config: dict[str, Any], tracing: EnvoyTracing) -> None:
    """Envoy's OpenTelemetry tracer: one span per request, exported over OTLP/gRPC; an incoming
    W3C traceparent is its parent, and the upstream request carries Envoy's span as parent."""
    config["static_resources"]["clusters"].append(
        {
            "name": OTLP_CLUSTER,
            "type": "STRICT_DNS",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": _HTTP2,
            "load_assignment": {
                "cluster_name": OTLP_CLUSTER,
                "endpoints": [{"lb_endpoints": [{"endpoint": _socket(tracing.collector)}]}],
            },
        }
    )
    hcm = _hcm(config)
    # Clients may send their own x-request-id (the router honours it); Envoy must not read its
    # sampling decision out of it (it does for UUIDs, and never samples other ids).
    hcm["request_id_extension"] = {
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
            "pack_trace_reason": False,
            "use_request_id_for_trace_sampling": False,
        }
    }
    hcm["tracing"] = {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "2s"},
                "service_name": tracing.service_name,
            },
        }
    }
    # Export within a second (Envoy's default is every 5 s or 5 spans).
    layers = config.setdefault("layered_runtime", {}).setdefault("layers", [])
    layers.append(
        {
            "name": "tokenwire_tracing",
            "static_layer": {
                "tracing.opentelemetry.flush_interval_ms": 1000,
                "tracing.opentelemetry.min_flush_spans": 1,
            },
        }
    )
