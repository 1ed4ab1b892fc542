"""The four floors, held to the source: imports only go down, no circle, no late import of recompute.

Floors (DESIGN.md): core (torch-free) <- torch library <- harnesses <- front ends. The graph is built from
the source with ``ast``: every ``import``/``from ... import`` of a recompute module, and every
``importlib.import_module("recompute...")`` (the CLI's on-demand loads, ``recompute.cli._lazy``).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

FLOORS = {
    "recompute.core": 0,
    "recompute.models": 1,
    "recompute.checkpointing": 1,
    "recompute.chunked_loss": 1,
    "recompute.offload": 1,
    "recompute.parallel": 1,
    "recompute.trace": 1,
    "recompute.check_gradients": 1,
    "recompute.runtime": 1,
    "recompute._compat": 1,
    "recompute.bench": 2,
    "recompute.planning": 2,
    "recompute.compile_plan": 2,
    "recompute.check_formulas": 2,
    "recompute.train": 2,
    "recompute.report": 2,
    "recompute.integrations": 2,
    "recompute.cli": 3,
    "recompute.__main__": 3,
    "recompute": 3,  # the package root: the public API, core eagerly and the torch floor on first use
}
NAMES = ("core", "torch library", "harnesses", "front ends")
LOADERS = {"import_module", "torch_floor"}
"""Calls that load a module named by a string: ``importlib.import_module`` and the CLI's ``torch_floor``."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool
    """Inside a function or class body rather than at the module's top level."""
    late: bool = False
    """A load by ``LOADERS`` (on demand, by design) rather than an import statement."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((SRC / "recompute").rglob("*.py"))}


def floor(module: str) -> int:
    """The floor of the longest ``FLOORS`` prefix of ``module``."""
    owner = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len, default=None)
    if owner is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS and to DESIGN.md")
    return FLOORS[owner]


def unit(module: str) -> str:
    """``recompute.trace._run`` -> ``recompute.trace``; core modules are units of their own."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["core"] else parts[:2])


def resolve(name: str) -> str:
    """The recompute module an imported dotted name refers to (the longest module prefix)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    raise AssertionError(f"import of {name}, which is no module of recompute")


def imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{a.name}" for a in node.names]
    if (
        isinstance(node, ast.Call)
        and LOADERS & {getattr(node.func, "attr", None), getattr(node.func, "id", None)}
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def edges_of(module: str, path: Path) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[Edge] = []

    def visit(node: ast.AST, local: bool) -> None:
        targets = {resolve(n) for n in imported_names(node, package) if n == "recompute" or n.startswith("recompute.")}
        late = isinstance(node, ast.Call)
        found.extend(Edge(module, t, getattr(node, "lineno", 0), local, late) for t in sorted(targets - {module}))
        nested = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(tree, False)
    return found


EDGES = [e for m, p in MODULES.items() for e in edges_of(m, p)]


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        floor(module)


def test_imports_only_go_down() -> None:
    upward = [
        f"{e.source}:{e.line} ({NAMES[floor(e.source)]}) imports {e.target} ({NAMES[floor(e.target)]})"
        for e in EDGES
        if floor(e.target) > floor(e.source)
    ]
    assert not upward, "\n".join(upward)


def test_no_function_local_import_of_recompute() -> None:
    """Late imports are for torch and optional packages; recompute's modules are imported at the top."""
    late = [f"{e.source}:{e.line} imports {e.target} inside a function" for e in EDGES if e.local and not e.late]
    assert not late, "\n".join(late)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("level", ["module", "unit"])
def test_no_import_circle(level: str) -> None:
    key = (lambda m: m) if level == "module" else unit
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        if key(e.source) != key(e.target):
            graph.setdefault(key(e.source), set()).add(key(e.target))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_core_is_torch_free() -> None:
    """The core floor imports the standard library, numpy and itself: never torch."""
    allowed = set(sys.stdlib_module_names) | {"recompute", "numpy"}  # numpy: the planner's Pareto sets
    bad = []
    for module, path in MODULES.items():
        if floor(module) != 0:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for name in imported_names(node, module):
                if name and name.split(".")[0] not in allowed:
                    bad.append(f"{module}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_an_upward_and_a_local_import(tmp_path: Path) -> None:
    """The rules catch what they are for (a checker that finds nothing must be able to find something)."""
    fake = tmp_path / "mod.py"
    fake.write_text(
        "from recompute.cli import main\n\ndef f():\n    from recompute.trace import trace\n"
        "    return torch_floor('recompute.bench')\n"
    )
    edges = edges_of("recompute.core.fake", fake)
    found = [(e.target, e.local, e.late) for e in edges]
    assert found == [("recompute.cli", False, False), ("recompute.trace", True, False), ("recompute.bench", True, True)]
    assert floor(edges[0].target) > floor("recompute.core.fake")
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
