"""`tokenwire gateway`: one Envoy in front of many tokenwire replicas, with the endpoint picker.

    tokenwire gateway --backends 10.0.0.1:50051,10.0.0.2:50051 --metrics-port 9000 --http-port 8080

Each backend is a replica's router (gRPC HOST:PORT; `/METRICS_PORT` after it overrides
--metrics-port for that one). This process runs the endpoint picker (an ext_proc gRPC server
speaking GIE's endpoint-picker protocol, reading each replica's /metrics) and Envoy as a child:
REST/SSE, OpenAI and gRPC on --http-port, routed per request to the replica the picker chose
(prefix affinity balanced against queue length and KV usage), with active gRPC health checks,
outlier detection and retries of requests that failed before any response byte. --no-picker
leaves the choice to Envoy (least-request, or --lb-policy round_robin). SIGTERM/SIGINT stop
Envoy, then the picker. Envoy exiting on its own ends the command with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from service.app.env_flags import env_value
from service.app.gateway import Gateway, GatewaySettings, render_config
from service.app.scale_out import Endpoint, EnvoyTracing, ScaleOut
from service.observability.tracing import parse_endpoint
from service.picker.picker import EndpointPicker, PickerConfig
from service.picker.replicas import MetricNames, ReplicaSet, parse_backends
from service.picker.scoring import Weights
from service.picker.server import set_ready, start_server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    a = parser.add_argument
    a("--backends", required=True, help="replica routers, HOST:PORT[/METRICS_PORT] comma-separated")
    a(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus port of every backend that names none (the replicas' --prometheus-port)",
    )
    a("--metrics-path", default="/metrics")
    a("--http-port", type=int, default=int(env_value("HTTP_PORT") or 8080))
    a("--http-hostname", default=env_value("HTTP_HOSTNAME") or "0.0.0.0")
    a("--admin-port", type=int, default=0, help="Envoy admin port on 127.0.0.1 (0: any free)")
    a("--max-request-bytes", type=int, default=None)
    a("--no-picker", action="store_true", help="let Envoy balance (see --lb-policy)")
    a(
        "--lb-policy",
        choices=["least_request", "round_robin"],
        default="least_request",
        help="Envoy's balancing without the picker, and the picker's fallback",
    )
    a("--picker-host", default="127.0.0.1")
    a("--picker-port", type=int, default=0, help="the picker's ext_proc port (0: any free)")
    a("--scrape-interval", type=float, default=0.2, help="seconds between metric scrapes")
    a("--prefix-weight", type=float, default=Weights.prefix)
    a("--queue-weight", type=float, default=Weights.queue)
    a("--kv-weight", type=float, default=Weights.kv)
    a(
        "--balance-slack",
        type=float,
        default=Weights.balance_slack,
        help="requests of load above the least-loaded replica beyond which affinity is ignored",
    )
    a(
        "--max-share",
        type=float,
        default=Weights.max_share,
        help="a replica whose recent share of requests exceeds this many times the mean gets "
        "no affinity credit (hot prefixes spread)",
    )
    a(
        "--chunk-chars",
        type=int,
        default=PickerConfig.chunk_chars,
        help="prompt characters per prefix-index chunk",
    )
    names = MetricNames()
    a("--queued-requests-metric", default=names.waiting)
    a("--running-requests-metric", default=names.running)
    a("--kv-cache-usage-metric", default=names.kv_usage)
    a("--cache-info-metric", default=names.cache_info)
    a("--serving-metric", default=names.serving)
    a("--health-check-interval", type=float, default=1.0, help="seconds between health checks")
    a("--num-retries", type=int, default=2)
    a(
        "--otlp-endpoint",
        default=env_value("OTLP_ENDPOINT"),
        help="OTLP/gRPC collector (HOST:PORT or http://HOST:PORT) for Envoy's spans",
    )
    a(
        "--otlp-service-name",
        default=env_value("OTLP_SERVICE_NAME") or "tokenwire",
        help="service name prefix; Envoy reports as NAME.gateway",
    )
    a("--envoy-dir", type=Path, default=None)
    a("--log-level", default="warning", help="Envoy's log level")
    a("--print-config", action="store_true", help="print Envoy's config and exit")


def settings_from(args: argparse.Namespace, picker_port: int | None) -> GatewaySettings:
    backends = parse_backends(args.backends, args.metrics_port, args.metrics_path)
    tracing = None
    if args.otlp_endpoint:
        host, port = parse_endpoint(args.otlp_endpoint)
        tracing = EnvoyTracing(Endpoint(host, port), f"{args.otlp_service_name}.gateway")
    scale = ScaleOut(
        backends=tuple(Endpoint(b.host, b.port) for b in backends),
        picker=None if picker_port is None else Endpoint(args.picker_host, picker_port),
        lb_policy=args.lb_policy,
        health_interval_s=args.health_check_interval,
        num_retries=args.num_retries,
    )
    first = backends[0]
    return GatewaySettings(
        http_port=args.http_port,
        http_host=args.http_hostname,
        router_host=first.host,
        router_port=first.port,
        admin_port=args.admin_port,
        max_request_bytes=args.max_request_bytes,
        scale_out=scale,
        tracing=tracing,
        **({"envoy_dir": args.envoy_dir} if args.envoy_dir else {}),
    )


def _log(message: str) -> None:
    print(f"tokenwire gateway: {message}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backends = parse_backends(args.backends, args.metrics_port, args.metrics_path)
    server = poller = None
    picker_port: int | None = None
    if not args.no_picker:
        names = MetricNames(
            waiting=args.queued_requests_metric,
            running=args.running_requests_metric,
            kv_usage=args.kv_cache_usage_metric,
            cache_info=args.cache_info_metric,
            serving=args.serving_metric,
        )
        picker: EndpointPicker | None = None
        replicas = ReplicaSet(backends, names, on_reset=lambda e: picker and picker.forget(e))
        picker = EndpointPicker(
            replicas,
            PickerConfig(
                weights=Weights(
                    prefix=args.prefix_weight,
                    queue=args.queue_weight,
                    kv=args.kv_weight,
                    balance_slack=args.balance_slack,
                    max_share=args.max_share,
                ),
                chunk_chars=args.chunk_chars,
            ),
        )
        server, picker_port, health_servicer = await start_server(
            picker, args.picker_host, args.picker_port
        )
        await replicas.poll_once()
        poller = asyncio.ensure_future(replicas.poll_forever(args.scrape_interval))
        await set_ready(health_servicer)
        ready = sum(r.ready for r in replicas.replicas)
        _log(f"picker on {args.picker_host}:{picker_port}, {ready}/{len(backends)} replicas ready")
    gateway = Gateway(settings_from(args, picker_port), log_level=args.log_level)
    process = gateway.start()
    code = 0
    try:
        while not gateway.answers():
            if process.poll() is not None:
                _log(f"envoy exited with code {process.returncode}")
                return 1
            await asyncio.sleep(0.05)
        _log(
            f"ready: envoy on {args.http_hostname}:{args.http_port} in front of "
            f"{len(backends)} replica(s)"
        )
        while not stop.is_set():
            if process.poll() is not None:
                _log(f"envoy exited with code {process.returncode}")
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass
    finally:
        gateway.stop()
        if poller is not None:
            poller.cancel()
        if server is not None:
            await server.stop(grace=0.5)
    return code


def run(args: argparse.Namespace) -> int:
    if args.print_config:
        picker_port = None if args.no_picker else (args.picker_port or 9002)
        print(json.dumps(render_config(settings_from(args, picker_port)), indent=2))
        return 0
    try:
        return asyncio.run(serve(args))
    except ValueError as error:
        print(f"tokenwire gateway: error: {error}", file=sys.stderr)
        return 2
