"""The repository's layout rules (issue 24), read from the source with `ast`, importing nothing:

(a) no import cycle between the top-level packages, and `reach` imports none of the outer ones;
(b) no module imports a private (`_name`) name of another package, or reads a private attribute
    it does not define (`x._y` on another module, or on an object of another module's class);
    the Temporal SDK's internals only in `gateway_api/temporal_adapter.py`;
(c) no module over 500 lines, outside generated code, `bench/` and `tests/`.

Each rule has an allowlist of today's offenders (file -> why). An entry that no longer offends
fails the test too, so the lists can only shrink: whoever fixes a file deletes its line.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Root directories outside the rules: the docs site's generator script and build output.
NOT_SOURCE = frozenset({"docs", "site", "build"})

# `reach` is the bottom layer: these build on it, never the other way round.
OUTER = frozenset({"gateway_api", "workflows", "activities", "connectors", "agent_reach_sdk"})

MAX_LINES = 500

# The one module allowed to reach into the Temporal SDK's internals (the fast result path's
# `_bridge_worker`, `_start_workflow_response`, `__temporal_eagerly_started`), with a fallback.
TEMPORAL_ADAPTER = "gateway_api/temporal_adapter.py"

# Private reads that stay, each for a reason that is not ours to remove.
PRIVATE_READS_ALLOWED = {
    TEMPORAL_ADAPTER: "the Temporal SDK's internals, in one adapter, tested, with its fallback",
    "agent_reach_proto/wire.py": "aiomqtt has no public handle on the paho client it drives "
    "(pinned versions; tests/unit/test_connector_mqtt.py checks the assumption)",
}

# Underscored names that are public API: the rule is about privacy, not spelling.
PUBLIC_DESPITE_UNDERSCORE = frozenset(
    {
        "os._exit",  # documented: leave without interpreter teardown
        "argparse._SubParsersAction",  # what add_subparsers() returns; argparse names no other
    }
)

# ---- today's offenders: each entry must still offend, so the lists only shrink -------------

PRIVATE_IMPORTS_TODAY: dict[str, str] = {}

PRIVATE_READS_TODAY: dict[str, str] = {}

OVERSIZED_TODAY: dict[str, str] = {}


# ---- reading the source -----------------------------------------------------------------


@cache
def source_files() -> tuple[Path, ...]:
    """Every project module, relative to the root (no virtualenv, caches or build output)."""
    found = []
    for top in sorted(ROOT.iterdir()):
        if top.name.startswith(".") or top.name.endswith(".egg-info") or top.name in NOT_SOURCE:
            continue
        if top.is_dir():
            found += [p.relative_to(ROOT) for p in top.rglob("*.py")]
        elif top.suffix == ".py":
            found.append(top.relative_to(ROOT))
    return tuple(sorted(found))


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(rel: Path) -> str:
    """The package a module belongs to (a package's `__init__` belongs to the package)."""
    name = module_name(rel)
    return name if rel.name == "__init__.py" else name.rpartition(".")[0]


@cache
def modules() -> dict[str, Path]:
    return {module_name(rel): rel for rel in source_files()}


@cache
def tree(rel: Path) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"), filename=str(rel))


@cache
def top_level_names() -> frozenset[str]:
    return frozenset(m.split(".")[0] for m in modules())


def first_party(name: str) -> bool:
    return name.split(".")[0] in top_level_names()


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imported_names(rel: Path, module: ast.Module | None = None) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for every import, at any depth (lazy and TYPE_CHECKING ones too):
    `from a.b import c` gives a.b and a.b.c; relative imports are resolved."""
    for node in ast.walk(module or tree(rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(rel).split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def is_generated(rel: Path) -> bool:
    return rel.parts[0] == "agent_reach_proto" and "_pb2" in rel.name


# ---- (a) import cycles ---------------------------------------------------------------------


def package_graph() -> dict[str, dict[str, str]]:
    """top-level package -> {top-level package it imports: where, first seen}."""
    graph: dict[str, dict[str, str]] = {}
    for rel in source_files():
        here = module_name(rel).split(".")[0]
        for line, name in imported_names(rel):
            there = name.split(".")[0]
            if there != here and first_party(name):
                graph.setdefault(here, {}).setdefault(there, f"{rel}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every package that can reach itself, with one path back (a cycle per package in it)."""
    found: list[list[str]] = []
    for start in sorted(graph):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, {})):
                if nxt == start:
                    found.append([*path, start])
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = package_graph()
    described = [
        " -> ".join(cycle)
        + "  ("
        + ", ".join(graph[a][b] for a, b in itertools.pairwise(cycle))
        + ")"
        for cycle in cycles(graph)
    ]
    assert not described, "import cycles between packages:\n" + "\n".join(described)


def test_reach_imports_no_outer_package() -> None:
    offenders = [
        f"{rel}:{line} imports {name}"
        for rel in source_files()
        if rel.parts[0] == "reach"
        for line, name in imported_names(rel)
        if name.split(".")[0] in OUTER
    ]
    assert not offenders, "reach is the bottom layer:\n" + "\n".join(offenders)


# ---- (b) private names ---------------------------------------------------------------------


def defining_package(owner: str) -> str:
    """Where a private name under `owner` belongs: a module's package, or the package."""
    rel = modules().get(owner)
    if rel is not None and rel.name != "__init__.py":
        return owner.rpartition(".")[0]
    return owner


def private_imports(rel: Path, module: ast.Module | None = None) -> list[str]:
    """A private name of another first-party package, or any of the Temporal SDK's."""
    found: list[str] = []
    seen: set[tuple[int, str]] = set()
    for line, name in imported_names(rel, module):
        parts = name.split(".")
        for i, part in enumerate(parts[1:], start=1):
            if not is_private(part):
                continue
            owner = ".".join(parts[:i])
            name = f"{owner}.{part}"  # `from m._x import a, b`: m._x once, not m._x.a, m._x.b
            if (line, name) in seen:
                break
            seen.add((line, name))
            if first_party(name):
                if defining_package(owner) != package_of(rel):
                    found.append(f"{rel}:{line} imports {name}")
            elif parts[0] == "temporalio" and str(rel) != TEMPORAL_ADAPTER:
                found.append(f"{rel}:{line} imports the Temporal SDK's {name}")
            break
    return found


def defined_names(module: ast.Module) -> set[str]:
    """Names a module defines itself: its functions, classes, variables, arguments and the
    attributes it sets on `self`/`cls` (its own objects' fields)."""
    names: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


def module_aliases(module: ast.Module) -> set[str]:
    """Local names bound to a module by `import x` / `import x.y as z`."""
    names: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
    return names


def private_reads(rel: Path, module: ast.Module | None = None) -> list[str]:
    """`x._y` (or getattr(x, "_y")) where `_y` is not this module's own. In tests and benches,
    which look inside on purpose, only reads on another module (`module._y`) count."""
    module = module or tree(rel)
    own = defined_names(module)
    only_modules = rel.parts[0] in ("tests", "bench")
    aliases = module_aliases(module)
    found = []
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute):
            receiver, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            receiver, attr = node.args[0], node.args[1].value
        else:
            continue
        text = ast.unparse(receiver)
        if not is_private(attr) or text in ("self", "cls", "super()"):
            continue
        if f"{text}.{attr}" in PUBLIC_DESPITE_UNDERSCORE:
            continue
        if only_modules:
            if isinstance(receiver, ast.Name) and receiver.id in aliases:
                found.append(f"{rel}:{node.lineno} reads {text}.{attr}")
        elif attr not in own:
            found.append(f"{rel}:{node.lineno} reads {text}.{attr}")
    return found


def check_against(
    found: dict[str, list[str]], today: dict[str, str], allowed: dict[str, str] | None = None
) -> list[str]:
    """Problems: offenders not listed, and listed files that no longer offend."""
    problems = [
        line
        for rel, lines in sorted(found.items())
        if rel not in today and rel not in (allowed or {})
        for line in lines
    ]
    problems += [
        f"{rel} no longer offends: delete its line from the allowlist ({why})"
        for rel, why in sorted(today.items())
        if rel not in found
    ]
    return problems


def test_no_private_name_of_another_package_is_imported() -> None:
    found = {str(rel): hits for rel in source_files() if (hits := private_imports(rel))}
    problems = check_against(found, PRIVATE_IMPORTS_TODAY)
    assert not problems, "\n".join(problems)


def test_no_private_attribute_of_another_module_is_read() -> None:
    found = {
        str(rel): hits
        for rel in source_files()
        if not is_generated(rel) and (hits := private_reads(rel))
    }
    problems = check_against(found, PRIVATE_READS_TODAY, PRIVATE_READS_ALLOWED)
    assert not problems, "\n".join(problems)


# ---- (c) module size -----------------------------------------------------------------------


def test_no_module_over_500_lines() -> None:
    sizes = {
        str(rel): len((ROOT / rel).read_text(encoding="utf-8").splitlines())
        for rel in source_files()
        if rel.parts[0] not in ("bench", "tests") and not is_generated(rel)
    }
    found = {
        rel: [f"{rel}: {n} lines (at most {MAX_LINES})"]
        for rel, n in sizes.items()
        if n > MAX_LINES
    }
    problems = check_against(found, OVERSIZED_TODAY)
    assert not problems, "\n".join(problems)


# ---- the checks check themselves -------------------------------------------------------


def test_the_rules_see_what_they_forbid() -> None:
    """The readers flag made-up offenders and pass their fixed versions: a rule that read
    nothing would pass on any tree."""
    here = Path("reach/policy/made_up.py")
    bad = ast.parse(
        "from reach.store.redis import _mapped\n"
        "from ..store import _helper\n"
        "from temporalio.worker._workflow import X\n"
        "from reach.policy._own import fine\n"
    )
    assert [hit.split(" imports ")[1] for hit in private_imports(here, bad)] == [
        "reach.store.redis._mapped",
        "reach.store._helper",
        "the Temporal SDK's temporalio.worker._workflow",
    ]
    reads = ast.parse(
        "import reach.store as store\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, other, s):\n"
        "        return other._mine, s._r, getattr(s, '_p'), store._x, self._y\n"
    )
    assert sorted(hit.split(" reads ")[1] for hit in private_reads(here, reads)) == [
        "s._p",
        "s._r",
        "store._x",
    ]
    in_tests = [hit.split(" reads ")[1] for hit in private_reads(Path("tests/t.py"), reads)]
    assert in_tests == ["store._x"]
    assert cycles({"a": {"b": "x:1"}, "b": {"a": "y:2"}, "c": {"a": "z:3"}}) == [
        ["a", "b", "a"],
        ["b", "a", "b"],
    ]
    assert "reach" in package_graph()["gateway_api"]
