"""The package map in ARCHITECTURE.md, enforced: imports point one way and form no cycles.

Every import statement counts, including those inside functions (a deferred import is still a
dependency; it only hides a cycle from the interpreter). The rules are read off ARCHITECTURE.md's
table; a new module inherits the rules of the folder it lands in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("service", "shard")


@dataclass(frozen=True)
class Rule:
    """Modules under `package` must not import anything starting with one of `forbidden`;
    when `only` is set, they may import nothing outside the stdlib but those prefixes."""

    package: str
    forbidden: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    why: str = ""
    exempt: tuple[str, ...] = ()  # sub-packages the rule does not cover

    def covers(self, module: str) -> bool:
        return _matches(module, self.package) and not any(_matches(module, e) for e in self.exempt)

    def broken_by(self, name: str) -> bool:
        if any(_matches(name, f) for f in self.forbidden):
            return True
        if self.only is None or _is_stdlib(name):
            return False
        return not any(_matches(name, allowed) for allowed in self.only)


RULES: tuple[Rule, ...] = (
    Rule(
        "service",
        forbidden=("benchmarks", "tests"),
        why="the product never imports benchmarks or tests",
    ),
    Rule(
        "service",
        forbidden=("tokenwire.shard",),
        exempt=("service.shard_client", "service.testing"),
        why="only the shard client (and the fake shard) speak the internal protocol",
    ),
    Rule(
        "shard",
        forbidden=("service", "benchmarks", "tests"),
        why="shards know nothing of the router",
    ),
    Rule(
        "service",
        forbidden=("service.testing", "shard.testing"),
        exempt=("service.testing",),
        why="test doubles are for tests and benchmarks, never the product",
    ),
    Rule(
        "shard",
        forbidden=("shard.testing",),
        exempt=("shard.testing",),
        why="test helpers are for tests and benchmarks, never the product",
    ),
    Rule("shard.tools", forbidden=("shard.server", "shard.engine", "shard.runner", "shard.models")),
    Rule(
        "service.scheduler",
        only=("service.scheduler",),
        why="the scheduler is plain Python over its own contracts",
    ),
    Rule(
        "service.engine",
        forbidden=("grpc", "tokenwire", "service.api", "service.app", "service.shard_client"),
        why="the engine owns the typed ShardBackend protocol; app wires the gRPC client in",
    ),
    Rule(
        "service.generation",
        forbidden=("grpc", "tokenwire", "service.api", "service.app", "service.shard_client"),
        why="validation and tokenization are domain code",
    ),
    Rule(
        "service.shard_client",
        forbidden=("service.api", "service.app", "service.generation", "tokenwire.v1"),
        why="the only place that speaks the internal protocol, and nothing else",
    ),
    Rule(
        "service.api",
        forbidden=("tokenwire.shard", "service.shard_client", "service.app"),
        why="the public API layer never speaks the internal protocol",
    ),
    Rule(
        "service.observability",
        forbidden=("service.api", "service.app", "service.generation", "tokenwire"),
        why="logs and metrics read engine stats; the layers above them import them, not the reverse",
    ),
    Rule(
        "shard.kernels",
        only=("torch", "triton", "shard.kernels"),
        why="kernels depend on torch, triton and each other only",
    ),
    Rule(
        "shard.models",
        forbidden=("shard.server", "shard.runner", "shard.engine", "grpc", "tokenwire"),
        why="models assemble layers; they never see the server or protobuf",
    ),
    Rule(
        "shard.layers",
        forbidden=(
            "shard.server",
            "shard.runner",
            "shard.engine",
            "shard.models",
            "grpc",
            "tokenwire",
        ),
    ),
    Rule(
        "shard.attention",
        forbidden=(
            "shard.server",
            "shard.runner",
            "shard.engine",
            "shard.models",
            "shard.layers",
            "grpc",
            "tokenwire",
        ),
    ),
    Rule(
        "shard.engine",
        forbidden=("shard.server", "grpc", "tokenwire"),
        why="batch state is protocol-free",
    ),
    Rule("shard.runner", forbidden=("shard.server", "grpc", "tokenwire")),
    Rule(
        "shard.quantization",
        forbidden=("shard.server", "shard.runner", "shard.engine", "shard.models"),
    ),
    Rule(
        "shard.distributed",
        forbidden=("shard.server", "shard.runner", "shard.engine", "shard.models"),
    ),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Absolute names of every module `path` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            # `from pkg import sub` may import a submodule: count both spellings.
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def test_imports_point_the_way_architecture_md_says() -> None:
    modules = product_modules()
    violations: list[str] = []
    for module, path in modules.items():
        imports = sorted(imported_names(module, path))
        violations += [
            f"{module} imports {name} ({rule.package}: {rule.why or 'layering'})"
            for rule in RULES
            if rule.covers(module)
            for name in imports
            if rule.broken_by(name)
        ]
    assert not violations, "\n".join(violations)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest product module that `name` names (a `from x import f` names x)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def test_no_import_cycles_between_product_modules() -> None:
    modules = product_modules()
    graph = {
        m: {r for n in imported_names(m, p) if (r := _resolve(n, modules)) and r != m}
        for m, p in modules.items()
    }
    # A package's __init__ re-exporting its submodules is not a cycle through the package itself.
    for m, deps in graph.items():
        graph[m] = {d for d in deps if not m.startswith(d + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_importing_the_product_imports_no_benchmark_or_test_module() -> None:
    code = (
        "import sys, service, shard\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'tests'))\n"
        "print(bad)\n"
        "raise SystemExit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("module", "bad_import"),
    [
        ("service.engine.engine", "tokenwire.shard.v1.shard_pb2"),
        ("service.api.servicer", "tokenwire.shard.v1.shard_pb2"),
        ("service.scheduler.scheduler", "service.engine.contracts"),
        ("shard.kernels.gemv", "shard.distributed"),
        ("shard.models.llama", "shard.server.servicer"),
    ],
)
def test_the_rule_checker_catches_a_wrong_import(module: str, bad_import: str) -> None:
    """The checker itself can fail: a planted wrong import is reported."""
    assert any(rule.covers(module) and rule.broken_by(bad_import) for rule in RULES)
