"""No import cycles between pipeline modules, lazy (in-function) imports included (fast)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in (ROOT / "pipeline").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[mod] |= {n for n in names if n in modules and n != mod and not mod.startswith(n + ".") and n != "pipeline"}
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_lower_module_imports_a_stage() -> None:
    """Stages sit on top: a library module that imports a stage drags the stage's CLI and its whole closure into
    every caller (and into the stage's DVC deps), and invites cycles."""
    offenders = {m: sorted(n for n in deps if n.startswith("pipeline.stages.")) for m, deps in _graph().items()
                 if not m.startswith("pipeline.stages") and m != "pipeline.cli"}
    assert not {m: d for m, d in offenders.items() if d}
