"""The package's import graph has no circles, counting the imports inside functions too (a
function-local import that breaks a circle at load time still ties the two modules together)."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "flashguard").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(mod: str, f: Path, known) -> set[str]:
    """The package modules ``mod`` imports anywhere in its file (a package's own submodules left out)."""
    deps = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
            target = node.module if node.level == 0 else ".".join(
                base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in known else target)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
    return {d for d in deps if d in known and d != mod and not d.startswith(mod + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert _cycles(graph) == []


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
