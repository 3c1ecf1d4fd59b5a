"""The code's shape as figures (#53): size, complexity, long stage functions, imports that point back up.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_architecture.py [--out docs/architecture-figures.md]

Read with ``ast`` from the source, nothing imported:
- lines of ``pipeline/``, ``dags/`` and ``infra/local/`` (``*.py``, every line), split into code, blank, docstring and
  comment lines, by package, and the lines of the modules that only one optional feature uses (what folding it would
  take off, at the least: its settings, DAG and CLI entries live in shared modules);
- each function's cyclomatic complexity, McCabe's count: 1 + each ``if``/``elif``, conditional expression, loop,
  ``except`` handler, ``match`` case, comprehension (and each of its ``if``s), ``assert``, and each extra operand of
  ``and``/``or``; nested functions count apart;
- functions in ``pipeline/stages/`` longer than 60 lines (decorators and docstring included);
- the layers: each module's floor is the longest chain of pipeline imports below it (module-level imports only: an
  import inside a function is a dependency on demand); an import of a module on the same or a higher floor is part of
  a cycle, listed as an arrow pointing back up.

Prints a markdown report and writes it (and its figures as JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import publish

ROOT = Path(__file__).resolve().parents[1]
TREES = ("pipeline", "dags", "infra/local")
STAGES = "pipeline/stages"
CC_LIMIT, LENGTH_LIMIT = 15, 60  # the bounds: at most 8 functions over 15; no stage function over 60 lines
BRANCHES = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.Assert, ast.match_case)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# the optional product features #53's line bound would fold: the modules that are each one's alone (the rollout,
# routing, trace and config code that reaches them stays and would shrink too); pipeline/rl/grammar.py is train_pi's too
FEATURES = {"contextual bandit (supervisor)": ("pipeline/bandit/", "pipeline/stages/train_bandit.py"),
            "prompt optimisation": ("pipeline/prompt_optimizer.py", "pipeline/stages/train_prompt.py"),
            "local production stack (`make prod-stack`)": ("infra/local/",),
            "online RL (GRPO on CPU, verl + Agent Lightning on GPU)": ("pipeline/rl/", "pipeline/stages/train_ppo.py")}
SHARED = ("pipeline/rl/grammar.py",)


def complexity(fn: ast.AST) -> int:
    """McCabe's count for ``fn``'s own body (a nested function or class body is its own count)."""
    count, todo = 1, list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (*FUNCTIONS, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, BRANCHES):
            count += 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        todo.extend(ast.iter_child_nodes(node))
    return count


def functions(path: Path) -> list[dict[str, Any]]:
    tree = ast.parse(path.read_text(), str(path))
    out, todo = [], [(tree, "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCTIONS):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out.append({"file": str(path.relative_to(ROOT)), "name": prefix + child.name, "line": child.lineno,
                            "lines": (child.end_lineno or child.lineno) - start + 1, "cc": complexity(child)})
                todo.append((child, f"{prefix}{child.name}."))
            elif isinstance(child, ast.ClassDef):
                todo.append((child, f"{prefix}{child.name}."))
    return out


def kinds_of_line(path: Path) -> dict[str, int]:
    """Code, blank, docstring and comment lines of one file (a docstring: the string opening a module, class or function)."""
    text = path.read_text()
    rows = text.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, *FUNCTIONS)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    out = {"code": 0, "blank": 0, "docstring": 0, "comment": 0}
    for i, row in enumerate(rows, 1):
        kind = ("blank" if not row.strip() else "docstring" if i in doc else
                "comment" if row.lstrip().startswith("#") else "code")
        out[kind] += 1
    return out


def package(rel: str) -> str:
    """``pipeline/<sub>`` for a subpackage's file, ``pipeline/*.py`` for a top-level module, else its tree."""
    parts = rel.split("/")
    if parts[0] == "pipeline":
        return f"pipeline/{parts[1]}" if len(parts) > 2 else "pipeline/*.py"
    return next(t for t in TREES if rel.startswith(t + "/"))


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports at module level (``from pipeline import x`` names module ``pipeline.x``)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(subs or ({node.module} & known))
    return found - {module_name(path)}


def floors(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Each module's floor (0: imports no project module) and the arrows that point back up (into a cycle)."""
    back: list[tuple[str, str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    floor: dict[str, int] = {}

    def visit(m: str) -> int:
        state[m] = 1
        level = 0
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                back.append((m, dep))
                continue
            level = max(level, 1 + (floor[dep] if state.get(dep) == 2 else visit(dep)))
        state[m], floor[m] = 2, level
        return level

    sys.setrecursionlimit(10_000)
    for m in sorted(graph):
        if m not in state:
            visit(m)
    return floor, back


def measure() -> dict[str, Any]:
    files = sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if "__pycache__" not in p.parts)
    kinds = {str(p.relative_to(ROOT)): kinds_of_line(p) for p in files}
    lines = {f: sum(k.values()) for f, k in kinds.items()}
    by_package: Counter[str] = Counter()
    for f, n in lines.items():
        by_package[package(f)] += n
    fns = [f for p in files for f in functions(p)]
    known = {module_name(p) for p in files}
    graph = {module_name(p): imports(p, known) for p in files if p.parts[len(ROOT.parts)] == "pipeline"}
    floor, back = floors(graph)
    return {"created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "lines": sum(lines.values()), "lines_by_tree": {t: sum(n for f, n in lines.items() if f.startswith(t + "/"))
                                                           for t in TREES},
            "lines_by_kind": {k: sum(c[k] for c in kinds.values()) for k in ("code", "blank", "docstring", "comment")},
            "lines_by_package": dict(by_package.most_common()),
            "features": {name: sum(n for f, n in lines.items() if f.startswith(prefixes) and f not in SHARED)
                         for name, prefixes in FEATURES.items()},
            "functions": len(fns),
            "complex": sorted((f for f in fns if f["cc"] > CC_LIMIT), key=lambda f: -f["cc"]),
            "long_stage_functions": sorted((f for f in fns if f["file"].startswith(STAGES) and f["lines"] > LENGTH_LIMIT),
                                           key=lambda f: -f["lines"]),
            "floors": max(floor.values(), default=0) + 1, "back_arrows": [{"from": a, "to": b} for a, b in back]}


def report(doc: dict[str, Any]) -> list[str]:
    lines = ["# The code's shape (`benchmarks/bench_architecture.py`)", "",
             f"Generated {doc['created_at']} from the source (`ast`, nothing imported). The bounds are #53's.", "",
             "| figure | now | bound |", "| --- | --- | --- |",
             f"| lines of pipeline + dags + infra/local | {doc['lines']:,} "
             f"({', '.join(f'{t} {n:,}' for t, n in doc['lines_by_tree'].items())}) | ≤ 12,500 |",
             f"| functions with cyclomatic complexity > {CC_LIMIT} (of {doc['functions']:,}) | {len(doc['complex'])} | ≤ 8 |",
             f"| functions in pipeline/stages over {LENGTH_LIMIT} lines | {len(doc['long_stage_functions'])} | 0 |",
             f"| import floors (pipeline/) / arrows pointing back up | {doc['floors']} / {len(doc['back_arrows'])} | "
             "no arrow back up but those named in docs/architecture.md |", "",
             f"## Complexity > {CC_LIMIT}", "", "| function | cc | lines |", "| --- | --- | --- |"]
    lines += [f"| `{f['file']}:{f['line']}` {f['name']} | {f['cc']} | {f['lines']} |" for f in doc["complex"]]
    lines += ["", f"## Stage functions over {LENGTH_LIMIT} lines", "", "| function | lines | cc |", "| --- | --- | --- |"]
    lines += [f"| `{f['file']}:{f['line']}` {f['name']} | {f['lines']} | {f['cc']} |" for f in doc["long_stage_functions"]]
    lines += ["", "## Imports that point back up (module level)", ""]
    lines += [f"- `{a['from']}` → `{a['to']}`" for a in doc["back_arrows"]] or ["none"]
    kinds = doc["lines_by_kind"]
    lines += ["", "## Where the lines are", "",
              "By kind: " + ", ".join(f"{k} {n:,}" for k, n in kinds.items()) + ".", "",
              "| package | lines |", "| --- | --- |", *(f"| `{p}` | {n:,} |" for p, n in doc["lines_by_package"].items()), "",
              "The modules that are one optional feature's alone (folding it takes these off at the least; its settings, "
              "DAG and CLI entries and the code that reaches it sit in shared modules):", "",
              "| feature | its own modules' lines | total without them |", "| --- | --- | --- |",
              *(f"| {name} | {n:,} | {doc['lines'] - n:,} |" for name, n in doc["features"].items()),
              f"| all of them | {sum(doc['features'].values()):,} | {doc['lines'] - sum(doc['features'].values()):,} |"]
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs/architecture-figures.md"))
    args = parser.parse_args()
    doc = measure()
    publish(args.out, report(doc), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
