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


ENTRY_POINTS = {"main", "run", "check"}  # a stage's or a command's entry (check: its refusals before services)


def test_functions_take_the_config_sections_they_use() -> None:
    """Only entry points take the whole ``Params``; every other function takes the sections it reads, or says in a
    ``# whole Params: <why>`` comment right above it why it needs the whole object (e.g. it digests seven sections)."""
    offenders = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name in ENTRY_POINTS:
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if not any(a.annotation is not None and ast.unparse(a.annotation).split(" | ")[0] == "Params" for a in args):
                continue
            first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            comment = []
            while first > 0 and lines[first - 1].lstrip().startswith("#"):
                first -= 1
                comment.append(lines[first])
            if not any("whole Params:" in c for c in comment):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not offenders, "take the config sections, or say why not (# whole Params: ...): " + ", ".join(offenders)
