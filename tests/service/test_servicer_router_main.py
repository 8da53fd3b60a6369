"""`tokenwire router` flags: names the launcher relies on, environment fallbacks, defaults."""

from __future__ import annotations

import argparse
import os

import pytest

from service.app import router_flags as router_main


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    return parser.parse_args(argv)


def test_launcher_flags_parse() -> None:
    args = parse(
        [
            "--hostname", "0.0.0.0", "--port", "7000", "--shard-uds-path", "/tmp/x",
            "--model-id", "m", "--tokenizer", "/tmp/m", "--graceful-timeout", "5",
            "--max-concurrent-requests", "8", "--max-best-of", "3", "--max-stop-sequences", "2",
            "--max-top-n-tokens", "1", "--max-input-tokens", "100", "--max-total-tokens", "200",
            "--max-client-batch-size", "2", "--validation-workers", "1",
            "--max-batch-prefill-tokens", "300", "--max-batch-total-tokens", "4000",
            "--max-batch-size", "16", "--waiting-served-ratio", "0.5", "--max-waiting-tokens", "10",
            "--prometheus-port", "9100", "--api-key", "k", "--json-output",
        ]
    )  # fmt: skip
    assert (args.port, args.max_best_of, args.json_output, args.api_key) == (7000, 3, True, "k")
    assert router_main.shard_target(args) == "unix:///tmp/x-0"


def test_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "7100")
    monkeypatch.setenv("MAX_CONCURRENT_REQUESTS", "9")
    monkeypatch.setenv("MAX_INPUT_LENGTH", "50")
    monkeypatch.setenv("API_KEY", "from-env")
    monkeypatch.setenv("JSON_OUTPUT", "true")
    args = parse([])
    assert (args.port, args.max_concurrent_requests, args.max_input_tokens) == (7100, 9, 50)
    assert args.api_key == "from-env" and args.json_output


def test_default_limits_follow_the_model() -> None:
    limits = router_main.resolve_limits(parse([]), max_position_embeddings=1024)
    assert (limits.max_input_tokens, limits.max_total_tokens) == (1023, 1024)
    assert limits.max_batch_prefill_tokens == 1073
    assert limits.max_batch_size == 128 * 2
    big = router_main.resolve_limits(parse([]), max_position_embeddings=131072)
    assert (big.max_input_tokens, big.max_total_tokens) == (4095, 4096)
    only_input = router_main.resolve_limits(parse(["--max-input-tokens", "100"]), 1024)
    assert (only_input.max_input_tokens, only_input.max_total_tokens) == (100, 1024)


def test_inconsistent_limits_are_refused() -> None:
    with pytest.raises(router_main.FlagError, match="--max-input-tokens"):
        router_main.resolve_limits(
            parse(["--max-input-tokens", "300", "--max-total-tokens", "300"]), 1024
        )
    with pytest.raises(router_main.FlagError, match="max_position_embeddings"):
        router_main.resolve_limits(parse(["--max-total-tokens", "2048"]), 1024)


def test_shard_address_wins() -> None:
    assert (
        router_main.shard_target(parse(["--shard-address", "127.0.0.1:5001"])) == "127.0.0.1:5001"
    )
    assert router_main.shard_target(parse([])) == "unix:///tmp/tokenwire-shard-0"


def test_launch_turns_off_grpc_fork_support_before_importing_grpc(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tokenwire launch` forks children with a pre-exec hook after using gRPC; with gRPC's fork
    handlers on, ~2 % of them died before their exec (exit -6). The CLI turns them off for
    `launch` (a user's own setting wins) and leaves other subcommands alone."""
    from service.app import cli

    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "unset-marker")
    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT")
    with pytest.raises(SystemExit):
        cli.main(["gateway", "--help"])
    assert "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "true")
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "true"
    capsys.readouterr()
