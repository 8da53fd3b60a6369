"""Flags of `tokenwire router`, and the settings resolved from them (token limits, engine limits,
shard address). Defaults read the environment variables TGI users know (PORT, MAX_INPUT_TOKENS,
...) when the parser is built, never at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.app.env_flags import env_bool, env_value
from service.engine.backend import WarmupBudgets
from service.engine.engine import EngineConfig
from service.generation.images.refs import ImageLimits
from service.generation.parsers.registry import AUTO as AUTO_TOOLS
from service.generation.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS
from service.generation.validation import ValidationLimits
from service.shard_client.client import DEFAULT_STEP_TIMEOUT_S

DEFAULT_SHARD_UDS_PATH = "/tmp/tokenwire-shard"
# TGI's defaults: max_total_tokens = min(max_position_embeddings, 4096), max_input = total - 1.
DEFAULT_TOTAL_TOKENS_CAP = 4096

_AddArgument = Callable[..., argparse.Action]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tokenwire router`, one argument group per concern."""
    parser.description = "serve the public gRPC API in front of running shards"
    group = parser.add_argument_group
    _listening_flags(group("listening").add_argument)
    _shard_flags(group("shards").add_argument)
    _request_limit_flags(group("request limits").add_argument)
    _image_flags(group("images (vision-language models)").add_argument)
    _batching_flags(group("batching").add_argument)
    _observability_flags(group("observability").add_argument)
    _process_flags(group("processes").add_argument)


def _listening_flags(a: _AddArgument) -> None:
    a(
        "--hostname",
        default=env_value("HOSTNAME") or "127.0.0.1",
        help="address the gRPC server listens on [HOSTNAME] (default 127.0.0.1)",
    )
    a(
        "--port",
        type=int,
        default=int(env_value("PORT") or 50051),
        help="gRPC port; 0 picks a free one [PORT] (default 50051)",
    )
    a(
        "--api-key",
        default=env_value("API_KEY"),
        help="require 'authorization: Bearer KEY' metadata on generation calls (health and "
        "reflection stay open) [API_KEY]",
    )


def _shard_flags(a: _AddArgument) -> None:
    a(
        "--shard-uds-path",
        default=env_value("SHARD_UDS_PATH"),
        help="unix socket prefix of the shards: rank 0 listens on unix://PREFIX-0 and names the "
        f"others [SHARD_UDS_PATH] (default {DEFAULT_SHARD_UDS_PATH})",
    )
    a(
        "--shard-address",
        default=env_value("SHARD_ADDRESS"),
        help="HOST:PORT of shard rank 0 instead of a unix socket [SHARD_ADDRESS]",
    )
    a(
        "--model-id",
        default=env_value("MODEL_ID"),
        help="model id reported by Info (default: what the shard reports) [MODEL_ID]",
    )
    a(
        "--tokenizer",
        type=Path,
        default=env_value("TOKENIZER"),
        help="directory holding tokenizer.json, or the file (default: the resolved --model-id "
        "directory, else the shard's model directory) [TOKENIZER]",
    )
    a("--startup-timeout", type=float, default=float(env_value("STARTUP_TIMEOUT") or 600.0),
      help="seconds to wait for the shards to answer and warm up (default 600)")  # fmt: skip
    a(
        "--shard-step-timeout",
        type=positive_seconds("--shard-step-timeout"),
        default=env_value("SHARD_STEP_TIMEOUT") or DEFAULT_STEP_TIMEOUT_S,
        help="seconds one batch step may take on the shards before the router declares them "
        "down (health NOT_SERVING, requests UNAVAILABLE): raise it for very long prefills on "
        f"slow hardware [SHARD_STEP_TIMEOUT] (default {DEFAULT_STEP_TIMEOUT_S:.0f})",
    )


def _responses_store_size(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--responses-store-size must be >= 0 (got {value})")
    return value


def _responses_store_ttl(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--responses-store-ttl must be > 0 (got {value})")
    return value


def _image_flags(a: _AddArgument) -> None:
    a(
        "--max-images-per-request",
        type=int,
        default=int(env_value("MAX_IMAGES_PER_REQUEST") or 8),
        help="most images in one request [MAX_IMAGES_PER_REQUEST] (default 8)",
    )
    a(
        "--max-image-pixels",
        type=int,
        default=int(env_value("MAX_IMAGE_PIXELS") or 4096 * 4096),
        help="most pixels (width x height) of one image [MAX_IMAGE_PIXELS] (default 4096x4096)",
    )
    a(
        "--max-image-bytes",
        type=int,
        default=int(env_value("MAX_IMAGE_BYTES") or 10 * 1024 * 1024),
        help="largest encoded image, data URL or fetched body; larger is a 413 "
        "[MAX_IMAGE_BYTES] (default 10 MiB: as base64 it stays under the public API's 16 MiB "
        "message limit)",
    )
    a(
        "--image-fetch-timeout",
        type=float,
        default=float(env_value("IMAGE_FETCH_TIMEOUT") or 10.0),
        help="seconds to fetch one image URL, redirects included [IMAGE_FETCH_TIMEOUT] "
        "(default 10)",
    )
    a(
        "--max-image-redirects",
        type=int,
        default=int(env_value("MAX_IMAGE_REDIRECTS") or 3),
        help="redirects followed when fetching an image URL [MAX_IMAGE_REDIRECTS] (default 3)",
    )
    a(
        "--allow-private-image-urls",
        action="store_true",
        default=env_bool("ALLOW_PRIVATE_IMAGE_URLS"),
        help="fetch image URLs whose host resolves to private, loopback, link-local or "
        "reserved addresses (refused by default: an image URL must not reach into the "
        "operator's network) [ALLOW_PRIVATE_IMAGE_URLS]",
    )
    a(
        "--allow-image-networks",
        type=_networks,
        default=_networks(env_value("ALLOW_IMAGE_NETWORKS") or ""),
        help="comma-separated CIDRs whose addresses image URLs may reach although private or "
        "loopback, e.g. an internal image store's 10.1.2.0/24 [ALLOW_IMAGE_NETWORKS]",
    )


def _networks(value: str) -> tuple[str, ...]:
    """CIDRs, checked now: a typo fails at start-up, not at the first image."""
    import ipaddress

    out = tuple(n.strip() for n in value.split(",") if n.strip())
    for n in out:
        try:
            ipaddress.ip_network(n, strict=False)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a network (CIDR): {n!r}") from None
    return out


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The image flags."""
    return ImageLimits(
        max_images=args.max_images_per_request,
        max_pixels=args.max_image_pixels,
        max_bytes=args.max_image_bytes,
        fetch_timeout_s=args.image_fetch_timeout,
        max_redirects=args.max_image_redirects,
        allow_private=args.allow_private_image_urls,
        allowed_networks=args.allow_image_networks,
    )


def _request_limit_flags(a: _AddArgument) -> None:
    a(
        "--responses-store-size",
        type=_responses_store_size,
        default=_responses_store_size(env_value("RESPONSES_STORE_SIZE") or "1024"),
        help="OpenAI Responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, per router process; the least recently used goes first when full "
        "(counted in tokenwire_responses_store_evictions{reason=\"size\"}); 0 stores none "
        "[RESPONSES_STORE_SIZE] (default 1024)",
    )
    a(
        "--responses-store-ttl",
        type=_responses_store_ttl,
        default=_responses_store_ttl(env_value("RESPONSES_STORE_TTL") or "3600"),
        help="seconds a stored Response is kept [RESPONSES_STORE_TTL] (default 3600)",
    )
    a(
        "--max-concurrent-requests",
        type=int,
        default=int(env_value("MAX_CONCURRENT_REQUESTS") or 128),
        help="client requests in flight (queued or running) before RESOURCE_EXHAUSTED; with "
        "--frontends N the limit is global: the front ends share one counter of admitted "
        "requests, so the excess is refused at once whichever front end it reaches "
        "[MAX_CONCURRENT_REQUESTS] (default 128)",
    )
    a(
        "--max-best-of",
        type=int,
        default=int(env_value("MAX_BEST_OF") or 2),
        help="largest best_of a request may ask for [MAX_BEST_OF] (default 2)",
    )
    a(
        "--max-stop-sequences",
        type=int,
        default=int(env_value("MAX_STOP_SEQUENCES") or 4),
        help="most stop sequences per request [MAX_STOP_SEQUENCES] (default 4)",
    )
    a(
        "--max-top-n-tokens",
        type=int,
        default=int(env_value("MAX_TOP_N_TOKENS") or 5),
        help="largest top_n_tokens per request [MAX_TOP_N_TOKENS] (default 5)",
    )
    a(
        "--max-input-tokens",
        type=int,
        default=_opt_int("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
        help="longest prompt in tokens, after truncation [MAX_INPUT_TOKENS] (default "
        "max-total-tokens - 1)",
    )
    a(
        "--max-total-tokens",
        type=int,
        default=_opt_int("MAX_TOTAL_TOKENS"),
        help="prompt + generated tokens of one request [MAX_TOTAL_TOKENS] (default "
        f"min(max_position_embeddings, {DEFAULT_TOTAL_TOKENS_CAP}), or max-input-tokens + 1 "
        "when only that is set)",
    )
    a(
        "--max-client-batch-size",
        type=int,
        default=int(env_value("MAX_CLIENT_BATCH_SIZE") or 4),
        help="most inputs in one client batch (reported by Info) [MAX_CLIENT_BATCH_SIZE] "
        "(default 4)",
    )
    a(
        "--chat-template",
        type=Path,
        default=env_value("CHAT_TEMPLATE"),
        help="Jinja chat template file for /v1/chat/completions and Chat, instead of the one in "
        "the model's tokenizer_config.json [CHAT_TEMPLATE]",
    )
    a(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        default=env_value("REASONING_PARSER") or "none",
        help="split a thinking model's reasoning from its answer: think (<think>...</think> of "
        "Qwen3, DeepSeek-R1, SmolLM3) puts it in reasoning_content, and grammars (tools, "
        "response_format) apply after it; none leaves it in the content [REASONING_PARSER] "
        "(default none)",
    )
    a(
        "--tool-call-parser",
        choices=[*TOOL_CALL_PARSERS, AUTO_TOOLS],
        default=env_value("TOOL_CALL_PARSER") or AUTO_TOOLS,
        help="the model family's tool-call format, for parsing calls and for the grammar of "
        "tool_choice required / named; auto reads it from the chat template, else hermes "
        "[TOOL_CALL_PARSER] (default auto)",
    )
    a(
        "--validation-workers",
        type=int,
        default=int(env_value("VALIDATION_WORKERS") or 2),
        help="tokenizer threads [VALIDATION_WORKERS] (default 2)",
    )


def _batching_flags(a: _AddArgument) -> None:
    a(
        "--max-batch-prefill-tokens",
        type=int,
        default=_opt_int("MAX_BATCH_PREFILL_TOKENS"),
        help="most prompt tokens computed in one step (longer prompts are chunked) "
        "[MAX_BATCH_PREFILL_TOKENS] (default max-input-tokens + 50)",
    )
    a(
        "--max-batch-total-tokens",
        type=int,
        default=_opt_int("MAX_BATCH_TOTAL_TOKENS"),
        help="cap on the KV cache in tokens, all requests together [MAX_BATCH_TOTAL_TOKENS] "
        "(default: what fits, found by warmup)",
    )
    a(
        "--max-batch-size",
        type=int,
        default=_opt_int("MAX_BATCH_SIZE"),
        help="most requests in one step [MAX_BATCH_SIZE] (default max-concurrent-requests x "
        "max-best-of)",
    )
    a(
        "--waiting-served-ratio",
        type=float,
        default=float(env_value("WAITING_SERVED_RATIO") or 0.3),
        help="admit waiting requests into a running batch when waiting/running exceeds this "
        "[WAITING_SERVED_RATIO] (default 0.3)",
    )
    a(
        "--max-waiting-tokens",
        type=int,
        default=int(env_value("MAX_WAITING_TOKENS") or 20),
        help="decode steps a waiting request may wait before forcing a prefill "
        "[MAX_WAITING_TOKENS] (default 20)",
    )
    a(
        "--speculate",
        type=int,
        default=int(env_value("SPECULATE") or 0),
        help="speculative decoding: up to N n-gram (prompt lookup) draft tokens per sequence "
        "and step, verified in the same forward pass [SPECULATE] (default 0: off)",
    )
    a(
        "--speculate-max-batch-size",
        type=int,
        default=int(env_value("SPECULATE_MAX_BATCH_SIZE") or 16),
        help="no drafts in steps with more running requests (a large batch is compute-bound) "
        "[SPECULATE_MAX_BATCH_SIZE] (default 16)",
    )
    a(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=(env_value("OVERLAP") or "on").lower() not in ("0", "false", "no", "off"),
        help="schedule and send step N+1 before step N's answer is read, so the shard prepares "
        "and launches it while the GPU computes step N and finishes step N while it computes "
        "N+1 (same outputs; --no-overlap: one step at a time, for A/B) [OVERLAP] (default on)",
    )
    a(
        "--router-detokenize",
        action=argparse.BooleanOptionalAction,
        default=_auto_bool(env_value("ROUTER_DETOKENIZE")),
        help="turn tokens into text and match stop sequences in the router's front-end "
        "processes instead of on the shard's step path; the shard returns token ids only "
        "(same outputs). Default (unset or 'auto'): on with --frontends >= 2, where N "
        "processes share that work beside the scheduler; off with one process, where it would "
        "take the scheduler's core (benchmarks/OVERLAP.md, 'Text off the shard'). "
        "--no-router-detokenize: the shard makes the text [ROUTER_DETOKENIZE=auto|on|off]",
    )


def _observability_flags(a: _AddArgument) -> None:
    a(
        "--prometheus-port",
        type=int,
        default=int(env_value("PROMETHEUS_PORT") or 0),
        help="serve Prometheus metrics at http://HOSTNAME:PORT/metrics; 0 = off. With "
        "--frontends N >= 2: PORT serves the scheduler process (engine metrics: KV blocks, "
        "queue, batch, scheduler CPU) and the front ends' request metrics summed at each "
        "scrape, and PORT+1 .. PORT+N serve front end 1 .. N alone (request metrics: counts, "
        "latencies, tokens, in flight; their engine gauges are copies of the scheduler's, "
        "refreshed every 0.25 s) [PROMETHEUS_PORT] (default 0)",
    )
    a(
        "--prometheus-hostname",
        default=env_value("PROMETHEUS_HOSTNAME") or "0.0.0.0",
        help="address of the metrics endpoint [PROMETHEUS_HOSTNAME] (default 0.0.0.0)",
    )
    a(
        "--json-output",
        action="store_true",
        default=env_bool("JSON_OUTPUT"),
        help="log one JSON object per line [JSON_OUTPUT]",
    )
    a("--log-level", default=env_value("LOG_LEVEL") or "INFO", help="[LOG_LEVEL] (default INFO)")
    a(
        "--otlp-endpoint",
        default=env_value("OTLP_ENDPOINT"),
        help="OpenTelemetry collector (OTLP/gRPC, HOST:PORT or http://HOST:PORT): trace every "
        "request (validate, queue, prefill, decode, stream spans; the caller's W3C traceparent "
        "is honoured) [OTLP_ENDPOINT] (default: tracing off)",
    )
    a(
        "--otlp-service-name",
        default=env_value("OTLP_SERVICE_NAME") or "tokenwire",
        help="service name prefix of the spans: the router reports as NAME.router "
        "[OTLP_SERVICE_NAME] (default tokenwire)",
    )


def _process_flags(a: _AddArgument) -> None:
    a(
        "--graceful-timeout",
        type=float,
        default=float(env_value("GRACEFUL_TIMEOUT") or 30.0),
        help="seconds to finish in-flight requests after SIGTERM [GRACEFUL_TIMEOUT] (default 30)",
    )
    a(
        "--shutdown-delay",
        type=float,
        default=float(env_value("SHUTDOWN_DELAY") or 0.0),
        help="after SIGTERM, stay up at least this many seconds (at most --graceful-timeout) "
        "answering health checks with NOT_SERVING and new requests with UNAVAILABLE, even when "
        "in-flight requests finish sooner, so that a load balancer polling health (Envoy's "
        "gRPC checks in `tokenwire gateway`: 2 checks 1 s apart) sees the drain instead of a "
        "closed port [SHUTDOWN_DELAY] (default 0; `launch --replicas` gives its replicas 2)",
    )
    a(
        "--frontends",
        type=frontends_value,
        default=env_value("FRONTENDS") or AUTO,  # a string: argparse converts (and checks) it
        help="public gRPC processes, N or 'auto'. 1: one process runs everything. N >= 2: one "
        "scheduler process runs the engine and N front-end processes (validation, "
        "tokenization, streaming) share --port through SO_REUSEPORT; streaming many tokens/s "
        "then uses more than one core (benchmarks/ROUTER.md). auto: 1 when this process may "
        "use fewer than 8 CPUs, else min(4, CPUs // 4) [FRONTENDS] (default auto)",
    )
    a(
        "--frontend-backlog-steps",
        type=float,
        default=float(env_value("FRONTEND_BACKLOG_STEPS") or 8.0),
        help="with --frontends N >= 2: steps' worth of token events a front end may hold "
        "unwritten before it lets the engine run further ahead. More: each stream writes "
        "several queued tokens per wakeup (less CPU per token), but requests finish in the "
        "engine before their tokens are written (smaller batches) and tokens wait longer. "
        "Fewer: tighter pacing, more CPU per token [FRONTEND_BACKLOG_STEPS] (default 8)",
    )


AUTO = "auto"
# `--frontends auto`: front ends only where the host has cores to spare for them (a front end
# streams on one core; the scheduler process and the shards need theirs), at most 4 (what
# benchmarks/RESULTS.md measured on a 16-core GPU host).
AUTO_FRONTENDS_MIN_CPUS = 8
AUTO_FRONTENDS_MAX = 4


def positive_seconds(flag: str) -> Callable[[str], float]:
    """An argparse type: a duration in seconds > 0, the error naming `flag`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a number of seconds (got {text!r})"
            ) from None
        if not value > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{flag} must be > 0 seconds (got {text})")
        return value

    return parse


def frontends_value(text: str) -> int | str:
    """--frontends / FRONTENDS: a count >= 1, or 'auto' (resolved by resolve_frontends)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--frontends must be an integer >= 1 or 'auto' (got {text!r})"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--frontends must be >= 1 or 'auto' (got {value})")
    return value


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_frontends(value: int | str, cpus: int | None = None) -> int:
    """The number of front-end processes: `value` itself when it is a count; for 'auto', 1
    under AUTO_FRONTENDS_MIN_CPUS usable CPUs, else min(AUTO_FRONTENDS_MAX, cpus // 4)."""
    if value != AUTO:
        return int(value)
    if cpus is None:
        cpus = usable_cpus()
    if cpus < AUTO_FRONTENDS_MIN_CPUS:
        return 1
    return min(AUTO_FRONTENDS_MAX, cpus // 4)


def _auto_bool(value: str | None) -> bool | None:
    """An on/off environment value; None for unset or 'auto' (decided once the rest is known)."""
    if value is None or value.lower() == AUTO:
        return None
    return value.lower() not in ("0", "false", "no", "off")


def resolve_router_detokenize(value: bool | None, frontends: int) -> bool:
    """--router-detokenize: as given, or for 'auto' on exactly when there are front ends."""
    return frontends > 1 if value is None else value


def _opt_int(*names: str) -> int | None:
    value = env_value(*names)
    return None if value is None else int(value)


@dataclass(frozen=True)
class Limits:
    """Token limits after defaults are resolved against the model."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int


class FlagError(ValueError):
    """A flag value, or a combination with what the model allows, that cannot be served. Raised
    where the check needs the shards (after start-up began); the router's entry point prints the
    message, which names the flag and the limit, as one line and exits 2 (argparse's code for a
    usage error)."""


def resolve_limits(args: argparse.Namespace, max_position_embeddings: int) -> Limits:
    """Fills the token limits the user left unset (TGI's rules) and checks them."""
    total = args.max_total_tokens
    inputs = args.max_input_tokens
    if total is None:
        total = (
            inputs + 1
            if inputs is not None
            and inputs + 1 > min(max_position_embeddings, DEFAULT_TOTAL_TOKENS_CAP)
            else min(max_position_embeddings, DEFAULT_TOTAL_TOKENS_CAP)
        )
    if inputs is None:
        inputs = total - 1
    if not 0 < inputs < total:
        raise FlagError(
            f"--max-input-tokens ({inputs}) must be > 0 and < --max-total-tokens ({total})"
        )
    if total > max_position_embeddings:
        raise FlagError(
            f"--max-total-tokens ({total}) must be <= the model's max_position_embeddings "
            f"({max_position_embeddings})"
        )
    prefill = args.max_batch_prefill_tokens
    if prefill is None:
        prefill = inputs + 50
    batch_size = args.max_batch_size or args.max_concurrent_requests * args.max_best_of
    return Limits(inputs, total, prefill, batch_size)


def shard_target(args: argparse.Namespace) -> str:
    """gRPC target of shard rank 0."""
    if args.shard_address:
        return args.shard_address
    return f"unix://{args.shard_uds_path or DEFAULT_SHARD_UDS_PATH}-0"


def engine_config(args: argparse.Namespace, limits: Limits) -> EngineConfig:
    """The engine's limits from the router flags and the resolved token limits."""
    return EngineConfig(
        # best_of expands one client request into up to max_best_of sequences; the
        # client-request limit is enforced by GenerationService.
        max_concurrent_requests=args.max_concurrent_requests * args.max_best_of,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens,
        max_batch_size=limits.max_batch_size,
        waiting_served_ratio=args.waiting_served_ratio,
        max_waiting_tokens=args.max_waiting_tokens,
        speculate=args.speculate,
        speculate_max_batch_size=args.speculate_max_batch_size,
        overlap=args.overlap,
    )


def validation_limits(args: argparse.Namespace, limits: Limits) -> ValidationLimits:
    """What one client request may ask for, from the router flags and the resolved limits."""
    return ValidationLimits(
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_top_n_tokens=args.max_top_n_tokens,
        max_client_batch_size=args.max_client_batch_size,
    )


def warmup_budgets(args: argparse.Namespace, limits: Limits) -> WarmupBudgets:
    """What the shards must support (their Warmup), from the resolved limits."""
    return WarmupBudgets(
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_size=limits.max_batch_size,
        max_batch_total_tokens=args.max_batch_total_tokens,
        speculate_tokens=args.speculate,
        speculate_max_batch_size=args.speculate_max_batch_size,
    )
