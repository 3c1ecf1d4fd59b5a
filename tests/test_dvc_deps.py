"""`dvc repro` re-runs a stage when code it runs changes: each stage's deps cover its project-import closure.

The closure follows every ``import`` of project code from the stage's module, inside functions too (most
imports here are lazy), transitively. A file in it must sit under one of the stage's ``dvc.yaml`` deps,
unless it is plumbing listed in ``PLUMBING`` with the reason it cannot change a stage's outputs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.cli import COMMANDS
from tests.conftest import ROOT, dvc_stages

# Files that run in every stage but cannot change what a stage writes (each with why). Kept short on purpose.
PLUMBING = {
    "pipeline/__init__.py": "package marker",
    "pipeline/cli.py": "argument parsing and dispatch to the stage module",
    "pipeline/config.py": "the params schema: the values themselves are DVC params deps",
    "pipeline/learning.py": "the kinds of learning the schema derives its role views from (the training, evaluate and "
                            "promote stages, whose outputs they change, list it)",
    "pipeline/io.py": "atomic writes and JSONL reading: how bytes land, not which",
    "pipeline/tracking.py": "MLflow run bookkeeping (what is logged, not what the stage writes)",
    "pipeline/runs.py": "pipeline run ids for MLflow grouping",
    "pipeline/timing.py": "wall-time records of a run (.runs/<run>/timings.jsonl): how long, not what a stage writes",
    "pipeline/plots.py": "matplotlib figure saving for MLflow artifacts",
    "pipeline/envs.py": "locating the model-plane interpreter (process dispatch)",
    "pipeline/services/__init__.py": "package marker",
    "pipeline/services/process.py": "process supervision of services (start, wait, stop)",
    "pipeline/services/supervise.py": "restarts a dead local engine (process supervision, not what it serves)",
    "pipeline/services/mlflow_server.py": "starts the local MLflow server (tracking, not outputs)",
    "pipeline/services/mlflow_users.py": "the local MLflow's users: who may write, not what a stage writes",
    "pipeline/serving/keys.py": "generated service keys and passwords: who may call, not what a stage computes",
    "pipeline/services/airflow_server.py": "starts Airflow (never from a stage's computation)",
    "pipeline/services/buckets.py": "S3 bucket bootstrap of the production stack",
    "pipeline/services/cli.py": "the services command line",
}


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + "." + "__init__"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = package.rsplit(".", node.level)[0]
                mod = f"{parent}.{node.module}" if node.module else parent
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)  # `from pipeline.x import module`
    return {n for n in names if n == "pipeline" or n.startswith("pipeline.")}


def closure(module: str) -> set[str]:
    todo, seen = [module], set()
    files: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        # importing pipeline.a.b runs pipeline/__init__ and pipeline/a/__init__ too
        parts = name.split(".")
        for i in range(1, len(parts)):
            todo.append(".".join(parts[:i]))
        path = _module_file(name)
        if path is None:
            continue
        files.add(path.relative_to(ROOT).as_posix())
        todo.extend(_imports(path))
    return files


def _marker(rel: str) -> bool:
    """A package ``__init__.py`` holding nothing but a docstring: no code to change any output."""
    if not rel.endswith("__init__.py"):
        return False
    body = ast.parse((ROOT / rel).read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def uncovered() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, stage in dvc_stages().items():  # DVC's own resolution: params interpolated, each foreach expanded
        command = stage["cmd"].split()[3]
        deps = [str(d).rstrip("/") for d in stage.get("deps", [])]
        missing = [f for f in sorted(closure(COMMANDS[command][0]))
                   if f not in PLUMBING and not _marker(f) and not any(f == d or f.startswith(d + "/") for d in deps)]
        if missing:
            out[name] = missing
    return out


def test_every_stage_depends_on_the_code_it_runs() -> None:
    missing = uncovered()
    assert not missing, "code a stage runs that none of its dvc.yaml deps covers (a change there would re-run nothing):\n" + "\n".join(
        f"  {stage}: {', '.join(files)}" for stage, files in missing.items())


def test_the_closure_follows_lazy_imports() -> None:
    files = closure("pipeline.stages.train_ppo")
    assert "pipeline/rl/guided.py" in files  # imported inside train_trl
    assert "pipeline/rewards/completion.py" in files and "pipeline/agents/llm.py" in files
