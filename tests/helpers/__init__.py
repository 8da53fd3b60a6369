"""Shared test helpers (every test uses these; none defines its own copy):

ports (free_port), processes (server processes, one Deployment, readiness), waiting (wait on a
condition, never sleep), metrics (one Prometheus scraper), http_api (REST/SSE calls), raw_grpc
(the API over generated stubs: the SDK tests' reference), models (tiny models, built once per
session), shards (in-process shards), engine_harness (the real engine on the fake shard),
engine_double (a scripted engine), router_harness (an in-process router), numerics, proto_json,
tools (missing tools skip, but fail under CI=true), triton_interpreter.
"""
