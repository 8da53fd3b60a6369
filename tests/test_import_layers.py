"""The package map in ARCHITECTURE.md, enforced: imports point one way and form no cycles.

Every import statement counts, including those inside functions (a deferred import is still a
dependency; it only hides a cycle from the interpreter). The rules are read off ARCHITECTURE.md's
table, so the document cannot drift from the code; a new module inherits its folder's row.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("service", "shard")


# Names an import is checked against: product packages, generated protobuf, gRPC, and the trees
# that must never be imported by the product.
CHECKED_ROOTS = ("service", "shard", "tokenwire", "grpc", "benchmarks", "tests")
KERNEL_LIBRARIES = ("torch", "triton")


def package_table() -> dict[str, tuple[str, ...]]:
    """ARCHITECTURE.md's package table: package -> what it may import (besides itself)."""
    table: dict[str, tuple[str, ...]] = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            table[cells[0].strip("`")] = tuple(re.findall(r"`([\w.]+)`", cells[2]))
    return table


def package_of(module: str, table: dict[str, tuple[str, ...]]) -> str | None:
    """The table row a module belongs to (the longest matching package)."""
    rows = [p for p in table if _matches(module, p)]
    return max(rows, key=len) if rows else None


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


def _is_checked(name: str) -> bool:
    return name.split(".")[0] in CHECKED_ROOTS


def violations_of(module: str, imports: set[str], table: dict[str, tuple[str, ...]]) -> list[str]:
    """The imports of `module` that its ARCHITECTURE.md row does not allow."""
    if module in PRODUCT_PACKAGES:  # the top-level __init__ files re-export nothing
        return []
    package = package_of(module, table)
    if package is None:
        return [f"{module} is in no package of ARCHITECTURE.md's table"]
    allowed = (package, *table[package])
    bad = [
        name
        for name in sorted(imports)
        if _is_checked(name)
        and not any(_matches(name, a) for a in allowed)
        # `import shard` / `from service import x` name only the top package
        and name not in PRODUCT_PACKAGES
    ]
    if package == "shard.kernels":
        bad += [
            name
            for name in sorted(imports)
            if not _is_checked(name)
            and not _is_stdlib(name)
            and name.split(".")[0] not in KERNEL_LIBRARIES
        ]
    return [f"{module} imports {name} (not in {package}'s row of ARCHITECTURE.md)" for name in bad]


def test_every_product_package_has_a_row() -> None:
    table = package_table()
    assert len(table) >= 15, table
    orphans = [
        m for m in product_modules() if m not in PRODUCT_PACKAGES and package_of(m, table) is None
    ]
    assert not orphans, orphans


def test_imports_point_the_way_architecture_md_says() -> None:
    table = package_table()
    violations = [
        v
        for module, path in product_modules().items()
        for v in violations_of(module, imported_names(module, path), table)
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
        ("service.api.servicer", "service.shard_client.client"),
        ("service.scheduler.scheduler", "service.engine.contracts"),
        ("service.app.launcher", "benchmarks.harness.bench"),
        ("shard.kernels.gemv", "shard.distributed.all_reduce_norm"),
        ("shard.kernels.gemv", "numpy"),
        ("shard.models.llama", "shard.server.servicer"),
        ("shard.runner.model_runner", "shard.testing.ranks"),
    ],
)
def test_the_rule_checker_catches_a_wrong_import(module: str, bad_import: str) -> None:
    """The checker itself can fail: a planted wrong import is reported."""
    assert violations_of(module, {bad_import}, package_table())


# transformers' modeling code serves models only through the transformers backend (shard.models);
# the model tools (shard.tools: GGUF conversion, tiny models, offline quantization, tokenizer
# files) read checkpoints with it; the router's image pipeline (service.generation.images) runs
# the model's own image processor (AutoProcessor). Nothing else imports it.
TRANSFORMERS_IMPORTERS = ("shard.models", "shard.tools", "service.generation.images")


def test_only_model_code_and_model_tools_import_transformers() -> None:
    offenders = [
        module
        for module, path in product_modules().items()
        if any(_matches(name, "transformers") for name in imported_names(module, path))
        and not any(_matches(module, allowed) for allowed in TRANSFORMERS_IMPORTERS)
    ]
    assert offenders == []
