"""Where one cycle's wall time goes, per stage: the fixed costs against the work, so the next cut is chosen by a figure.

    # run the command in a fresh clone of HEAD (beside this checkout, so ../shared resolves) and read its timings
    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_cycle.py --fresh-clone ../bench-clone [--out ...] -- make run
    # or read a cycle already run (its checkout and PIPELINE_RUN_ID; the latest run when none is named)
    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_cycle.py --checkout ../bench-clone [--run run-2026...]

Every stage process records its fixed costs in ``.runs/<run id>/timings.jsonl`` (``pipeline/timing.py``): its own
start-up and imports (control plane, and the model plane a trainer starts), the tracking server and parent run, the
serving plane ensured, model loads, registration and artifact logging; and the stage's whole wall time. The work is
the rest of the stage's wall time, set against what the stage did (its steps, rollouts, calls or questions, read
from ``reports/metrics``). What falls between the stages (environment check, services started by ``make run``, DVC
hashing and locking, the push) is the command's wall time less the stages'. Prints and writes a markdown table (and
JSON beside it): per stage wall, each fixed cost, fixed sum, work, its units and seconds per unit, and the fixed share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import publish

from pipeline.timing import FILE, Phase

FIXED = [("control start-up", Phase.STARTUP, "control"), ("tracking", Phase.TRACKING, "control"),
         ("serving", Phase.SERVING, "control"), ("model start-up", Phase.STARTUP, "model"),
         ("model load", Phase.MODEL_LOAD, "model"), ("registry", Phase.REGISTRY, "control")]
# what a stage's work is counted in: (metrics file under reports/metrics, key or key suffix summed, unit)
WORK: dict[str, tuple[str, str, str]] = {
    "ingest": ("ingest.json", "rows", "rows"), "validate": ("validate.json", "rows", "rows"),
    "build_index": ("build_index.json", "abstracts", "abstracts"), "rollouts": ("rollouts.json", "total.rollouts", "rollouts"),
    "datasets": ("datasets.json", "traces", "traces"), "train_sft": ("train_sft/{role}.json", "steps", "steps"),
    "train_pi": ("train_pi/{role}.json", "steps", "steps"), "train_ppo": ("train_ppo/{role}.json", "steps", "steps"),
    "train_prompt": ("train_prompt/{role}.json", "calls", "calls"),
    "train_bandit": ("train_bandit/{role}.json", "decisions", "decisions"),
    "evaluate": ("evaluate.json", ".n", "questions x candidates"), "report": ("report.json", "questions", "society questions"),
}


def work_units(checkout: Path, stage: str) -> tuple[float | None, str, float | None]:
    """(how much work, its unit, the seconds of it the stage timed itself: a trainer's optimizer steps)."""
    name, _, role = stage.partition("@")
    if name not in WORK:
        return None, "", None
    file, key, unit = WORK[name]
    path = checkout / "reports/metrics" / file.format(role="supervisor" if name == "train_bandit" else role)
    if not path.exists():
        return None, unit, None
    values = json.loads(path.read_text())
    full = checkout / "reports" / file.format(role=role)  # a trainer's whole report (its DVC metrics file leaves timings out)
    steps_s = json.loads(full.read_text()).get("train_seconds") if "{role}" in file and full.exists() else None
    steps_s = float(steps_s) if isinstance(steps_s, (int, float)) else None
    if key.startswith("."):
        found = [v for k, v in values.items() if k.endswith(key) and isinstance(v, (int, float))]
        return (float(sum(found)) if found else None), unit, steps_s
    value = values.get(key)
    return (float(value) if isinstance(value, (int, float)) else None), unit, steps_s


def latest_run(checkout: Path) -> str:
    runs = sorted((checkout / ".runs").glob(f"*/{FILE}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"error: no {FILE} under {checkout / '.runs'}: run a cycle first")
    return runs[-1].parent.name


def per_stage(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Seconds per stage and fixed cost; a line written before its process named the stage takes the stage its pid
    names later (a stage that ensured the serving plane before opening its run)."""
    stage_of_pid = {line["pid"]: line["stage"] for line in lines if line.get("stage")}
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        stage = line.get("stage") or stage_of_pid.get(line["pid"])
        if stage is None:
            continue
        key = "wall" if line["phase"] == Phase.STAGE else f"{line['phase']}:{line['plane']}"
        table[stage][key] += line["seconds"]
    return table


def analyse(checkout: Path, run: str, command_s: float | None) -> dict[str, Any]:
    lines = [json.loads(x) for x in (checkout / ".runs" / run / FILE).read_text().splitlines() if x.strip()]
    rows = []
    for stage, t in per_stage(lines).items():
        if not t.get("wall"):
            continue  # a process that never opened a stage run (a service command)
        fixed = {label: round(t.get(f"{phase}:{plane}", 0.0), 1) for label, phase, plane in FIXED}
        work = max(t["wall"] - sum(fixed.values()), 0.0)
        units, unit, steps_s = work_units(checkout, stage)
        rows.append({"stage": stage, "wall_s": round(t["wall"], 1), **fixed, "fixed_s": round(sum(fixed.values()), 1),
                     "work_s": round(work, 1), "steps_s": steps_s, "units": units, "unit": unit,
                     "s_per_unit": round(work / units, 2) if units else None,
                     "fixed_share": round(sum(fixed.values()) / t["wall"], 3)})
    stages_s = sum(r["wall_s"] for r in rows)
    fixed_s = sum(r["fixed_s"] for r in rows)
    # what make run's own script timed around the stages (scripts/run_pipeline.sh): services, dvc repro, the push
    command = {line["phase"]: round(line["seconds"], 1) for line in lines if line.get("plane") == "command"}
    if "dvc repro" in command:
        command["of dvc repro: DVC itself (hashing, locks, stage processes started)"] = round(command["dvc repro"] - stages_s, 1)
    return {"run": run, "command_s": command_s, "stages_s": round(stages_s, 1), "fixed_s": round(fixed_s, 1),
            "between_stages_s": round(command_s - stages_s, 1) if command_s else None, "stage_processes": len(rows),
            "rows": rows, "outside_stages": command}


def markdown(result: dict[str, Any], command: str) -> list[str]:
    head = ["stage", "wall", *[label for label, _, _ in FIXED], "fixed", "work", "of it optimizer steps", "work units",
            "s / unit", "fixed share"]
    out = [f"# Where one cycle's time goes: fixed costs against the work (`{command}`)", "",
           f"Run `{result['run']}`, measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by `benchmarks/bench_cycle.py`. "
           "Seconds; fixed = the stage's processes starting and importing, the tracking server and parent run, the "
           "serving plane ensured, model loads, registration and logging; work = the rest of the stage.", "",
           "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["rows"]:
        units = f"{r['units']:g} {r['unit']}" if r["units"] is not None else "-"
        per = f"{r['s_per_unit']:g}" if r["s_per_unit"] is not None else "-"
        steps = f"{r['steps_s']:.1f}" if r["steps_s"] is not None else "-"
        out.append(f"| {r['stage']} | {r['wall_s']:.1f} | " + " | ".join(f"{r[label]:.1f}" for label, _, _ in FIXED)
                   + f" | {r['fixed_s']:.1f} | {r['work_s']:.1f} | {steps} | {units} | {per} | {r['fixed_share']:.0%} |")
    total = result["command_s"]
    out += ["", f"- stages: {result['stages_s'] / 60:.1f} min in {result['stage_processes']} stage runs, of which fixed "
            f"{result['fixed_s'] / 60:.1f} min ({result['fixed_s'] / max(result['stages_s'], 1e-9):.0%})"]
    if total:
        out.append(f"- the command: {total / 60:.1f} min; between the stages (environment check, services started by the "
                   f"command, DVC hashing and locks, the push): {result['between_stages_s'] / 60:.1f} min")
        for name, seconds in result["outside_stages"].items():
            out.append(f"  - {name}: {seconds:.1f} s")
        overhead = result["fixed_s"] + result["between_stages_s"]
        out.append(f"- fixed costs and time between stages together: {overhead / total:.0%} of the command's wall time")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fresh-clone", type=Path, help="clone HEAD here (must not exist) and run the command in it")
    where.add_argument("--checkout", type=Path, help="read a cycle already run in this checkout")
    parser.add_argument("--run", help="its PIPELINE_RUN_ID (default: the latest under .runs/)")
    parser.add_argument("--command-s", type=float, help="the command's wall time, when it was measured elsewhere")
    parser.add_argument("--out", default="docs/benchmarks-cycle.md")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command, e.g. make run")
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"]
    command_s = args.command_s
    if args.fresh_clone:
        if args.fresh_clone.exists():
            raise SystemExit(f"error: {args.fresh_clone} exists: name a new directory")
        if not command:
            raise SystemExit("error: name the command after --, e.g. -- make run")
        subprocess.run(["git", "clone", "-q", str(Path.cwd()), str(args.fresh_clone)], check=True)
        checkout = args.fresh_clone
        run = f"bench-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
        t0 = time.monotonic()
        rc = subprocess.call(command, cwd=checkout, env={**env, "PIPELINE_RUN_ID": run})
        command_s = time.monotonic() - t0
        if rc != 0:
            print(f"error: {' '.join(command)} exited {rc} after {command_s / 60:.1f} min", file=sys.stderr)
            return rc
    else:
        checkout = args.checkout
        run = args.run or latest_run(checkout)
    result = analyse(checkout, run, command_s)
    publish(args.out, markdown(result, " ".join(command) or "a cycle"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
