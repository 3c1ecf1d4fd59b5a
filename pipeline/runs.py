"""Open and close the MLflow parent run of one pipeline run (``make run`` and the DAG use this).

``open`` prints the pipeline run id to export as ``PIPELINE_RUN_ID`` so that every stage process
logs its child run under the same parent; with ``--write-params`` it also writes the run's
*effective* params (the params file plus this process's ``PIPELINE__`` overrides, i.e. a DAG run's
UI Params) to ``.runs/<run id>/params.yaml`` and logs it on the parent run: every later task of the
run reads that file. ``commit-lock`` records the run's outputs in ``dvc.lock`` with the values that
produced them (DVC reads ``params.yaml``, so the effective file stands in for it during ``dvc commit``
and the original comes back after: a later ``dvc status`` then says which stages ran with other
values than the file holds). The live routing file is treated the same way: ``open`` snapshots it and
``commit-lock`` records the snapshot, because the run's ``promote`` rewrites it *after* ``rollouts`` and
``evaluate`` (its dependants) ran with the old one; recording the new one would say they rolled out with
the new champions, and the next run would not roll out again. ``close`` marks the parent finished or
failed; ``fail`` records a failed task on it (the DAG's failure callback); ``times`` prints each stage
run's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.config import DEFAULT_PARAMS, Params, effective_raw
from pipeline.io import write_text

RUNS_DIR = Path(".runs")


def effective_file(run_key: str) -> Path:
    return RUNS_DIR / run_key / "params.yaml"


def routing_snapshot(effective: Path) -> Path:
    """Where ``open`` keeps the live routing file as the run found it (beside the run's effective params)."""
    return effective.parent / "live-routing.json"


def write_effective(params_path: str | None, run_key: str, live_file: str | None = None) -> Path:
    """The run's effective params as a file (the params file's shape, overrides applied), and the live routing as it is
    now (``live_file``): what this run's rollouts and evaluation will be served by."""
    out = effective_file(run_key)
    write_text(out, f"# effective params of pipeline run {run_key}: {params_path or DEFAULT_PARAMS} + the run's overrides\n"
               + yaml.safe_dump(effective_raw(params_path), sort_keys=False))
    if live_file and Path(live_file).exists():
        write_text(routing_snapshot(out), Path(live_file).read_text())
    return out


@contextlib.contextmanager
def run_inputs(effective: Path, live_file: str | None = None) -> Iterator[None]:
    """What DVC reads, as the run saw it: the effective params standing in for params.yaml and, when ``open`` took one,
    the routing snapshot for ``live_file``; both restored whatever happens. Paths are relative to the project root."""
    stand_ins = [(Path(DEFAULT_PARAMS), effective)]
    if live_file and routing_snapshot(effective).exists() and Path(live_file).exists():
        stand_ins.append((Path(live_file), routing_snapshot(effective)))
    saved = [(target, target.read_bytes()) for target, _ in stand_ins]
    try:
        for target, stand_in in stand_ins:
            target.write_bytes(stand_in.read_bytes())
        yield
    finally:
        for target, data in saved:
            target.write_bytes(data)


def commit_lock(effective: Path, stages: list[str], live_file: str | None = None) -> None:
    """``dvc commit --force STAGES`` with the run's inputs standing in (``run_inputs``)."""
    with run_inputs(effective, live_file):
        subprocess.run([sys.executable, "-m", "dvc", "commit", "--force", *stages], check=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["open", "close", "fail", "times", "commit-lock"])
    parser.add_argument("--write-params", action="store_true",
                        help="open: write the run's effective params to .runs/<run id>/params.yaml")
    parser.add_argument("--stages", nargs="*", default=[], help="commit-lock: the stages whose outputs this run produced")
    parser.add_argument("--task", default=None, help="fail: the task that failed")
    parser.add_argument("--error", default="", help="fail: why")
    parser.add_argument("--try-number", type=int, default=None)
    parser.add_argument("--run-id", default=None, help="pipeline run id (default: $PIPELINE_RUN_ID or a new one)")
    parser.add_argument("--status", default="FINISHED", choices=["FINISHED", "FAILED", "KILLED"])


def main(args: argparse.Namespace, params: Params) -> int:
    if args.run_id:
        os.environ[tracking.RUN_ID_ENV] = args.run_id
    run_key = tracking.pipeline_run_id()
    if args.action == "commit-lock":
        effective = Path(args.params_path) if args.params_path else effective_file(run_key)
        commit_lock(effective, args.stages, params.serving.live_file)
        print(f"dvc.lock: {len(args.stages)} stage(s) committed with the params of {effective}")
        return 0
    mlflow_run = tracking.parent_run(params.mlflow)
    if args.action == "open" and args.write_params:
        from mlflow import MlflowClient  # noqa: PLC0415 - 1.3 s import; the DAG's tasks import this module for effective_file

        path = write_effective(args.params_path, run_key, params.serving.live_file)
        MlflowClient().log_artifact(mlflow_run, str(path), "params")
    if args.action == "close":
        tracking.finish_parent(params.mlflow, args.status)
    if args.action == "times":
        for stage, seconds in tracking.stage_times(params.mlflow):
            print(f"  {stage:<18} {seconds / 60:5.1f} min")
        return 0
    if args.action == "fail":
        if not args.task:
            print("error: `run fail` needs --task", file=sys.stderr)
            return 2
        tracking.record_failure(params.mlflow, args.task, args.error, args.try_number)
    print(f"{run_key} {mlflow_run} {tracking.experiment_id(params.mlflow)}")
    return 0
