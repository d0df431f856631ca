"""The project's import graph, read from the source (AST), follows its layers.

    harness, heads, training      top: the CLIs and the scripts that make models and heads
    reports, fixtures             reports read run files; fixtures are the built-in data and make_tiny
    decoders | audit              beside each other, never importing each other
    core                          the ground: imports nothing of this project

ALLOWED below is the exact rule: what each package may import besides itself.

Every import counts, at module level or inside a function: an import inside a function is still
a dependency, only a later one. ``bench/`` and ``tests/`` stand above everything.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what each package may import besides itself
ALLOWED = {
    "core": set(),
    "decoders": {"core"},
    "audit": {"core"},
    "reports": {"core"},
    "fixtures": {"core"},
    "training": {"core", "decoders", "fixtures"},
    "heads": {"core", "decoders", "training"},
    "harness": {"core", "decoders", "reports"},
}
PACKAGES = set(ALLOWED)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir()}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``path`` imports, resolved to the most specific module that exists
    (``from core import dist`` is ``core.dist``; ``from core.schema import dumps`` is ``core.schema``)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES:
                out.add(name)
    out.discard(here)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        out[top] |= {d.split(".")[0] for d in deps} - {top}
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert "core.schema" in graph and "audit.cli" in graph and "harness.cli" in graph
    assert "core.schema" in graph["audit.stream"]
    assert "decoders.runtime.runtime" in graph["decoders.fast_serial"]


def test_no_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, " -> ".join(cycle)


def test_no_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_each_package_imports_only_the_layers_below_it():
    bad = [f"{mod} imports {dep}" for mod, deps in sorted(import_graph().items()) for dep in sorted(deps)
           if dep.split(".")[0] != mod.split(".")[0] and dep.split(".")[0] not in ALLOWED[mod.split(".")[0]]]
    assert not bad, "\n".join(bad)


def test_the_ground_and_the_audit_stand_alone():
    pg = package_graph(import_graph())
    assert pg["core"] == set()
    assert pg["audit"] <= {"core"}
    assert "audit" not in pg["decoders"] and "decoders" not in pg["audit"]


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
