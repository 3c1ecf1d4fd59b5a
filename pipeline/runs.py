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
run's wall time. ``outputs`` says where each stage writes, from the params alone (no tracking server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.config import DEFAULT_PARAMS, PARAMS_ENV, MlflowParams, Params, effective_raw
from pipeline.io import write_text

RUNS_DIR = Path(".runs")


class RunError(ValueError):
    """An action that cannot name its pipeline run, refused in one line before any service starts."""


def TRACKING(args: argparse.Namespace) -> bool:  # the CLI's per-module switch (cli.tracks), here per action
    return args.action in ("open", "close", "fail", "times")  # the rest run DVC, or read params; each stage starts its own


def check(args: argparse.Namespace, params: Params) -> None:
    """The run an action acts on, refused before any service starts (the CLI calls this first): ``close``, ``fail`` and
    ``times`` name one (``--run-id`` or ``$PIPELINE_RUN_ID``, else they would open and end a new one); ``repro`` and
    ``status`` need its effective params (``open --write-params``)."""
    key = args.run_id or os.environ.get(tracking.RUN_ID_ENV)
    if args.action == "fail" and not args.task:
        raise RunError("`run fail` needs --task")
    if args.action in ("close", "fail", "times", "repro", "status") and not key:
        raise RunError(f"`run {args.action}`: which run? --run-id or ${tracking.RUN_ID_ENV} (what `run open` printed)")
    if args.action in ("repro", "status") and not (path := effective_file(str(key))).exists():
        raise RunError(f"{path}: no run {key} is open with its params; `python -m pipeline run open --write-params` "
                       "first and export the PIPELINE_RUN_ID it prints")


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


SAVED = RUNS_DIR / "stood-in"  # the originals while a run's inputs stand in for them (a crash's leftovers come back)


def restore_stood_in() -> list[str]:
    """Put back what a killed process left standing in (``SAVED``): the files it names, then the folder."""
    restored = []
    for saved in sorted(SAVED.glob("*")) if SAVED.is_dir() else []:
        target = Path(saved.name.replace("%", "/"))
        write_text(target, saved.read_text())
        saved.unlink()
        restored.append(target.as_posix())
    return restored


@contextlib.contextmanager
def run_inputs(effective: Path, live_file: str | None = None) -> Iterator[None]:
    """What DVC reads, as the run saw it: the effective params standing in for params.yaml and, when ``open`` took one,
    the routing snapshot for ``live_file``; both restored whatever happens, a SIGKILL included (the originals are kept
    under ``SAVED`` first, and the next stand-in or ``run open`` puts them back). Paths are relative to the project root."""
    if restored := restore_stood_in():
        print(f"runs: restored {restored} left standing in by a process that was killed", file=sys.stderr)
    stand_ins = [(Path(DEFAULT_PARAMS), effective)]
    if live_file and routing_snapshot(effective).exists() and Path(live_file).exists():
        stand_ins.append((Path(live_file), routing_snapshot(effective)))
    saved = [(target, target.read_bytes()) for target, _ in stand_ins]
    for target, data in saved:
        write_text(SAVED / target.as_posix().replace("/", "%"), data.decode())
    try:
        for target, stand_in in stand_ins:
            target.write_bytes(stand_in.read_bytes())
        yield
    finally:
        restore_stood_in()  # the originals, from the copies kept above


def repro(effective: Path, stages: list[str], single_item: bool, live_file: str, settle: list[str] | None = None) -> int:
    """``dvc repro STAGES`` with the run's effective params standing in for params.yaml (a profile such as
    params/learn.yaml is then what DVC records and compares): a stage runs only when its code, data or values changed
    since dvc.lock recorded them. A promotion among them moves the live routing after the stages that read it ran; of
    ``settle`` (default: STAGES), those whose only change is that routing are then recorded with it (the cycle's own
    decision), so the same cycle run again reproduces nothing."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the stand-in is restored on a TERM too (finally)
    dvc = [sys.executable, "-m", "dvc"]
    env = {k: v for k, v in os.environ.items() if k != PARAMS_ENV}  # the stages read what DVC reads: params.yaml
    with run_inputs(effective):
        rc = subprocess.run([*dvc, "repro", *(["--single-item"] if single_item else []), *stages], check=False,
                            env=env).returncode
        if rc != 0:
            return rc
        status = subprocess.run([*dvc, "status", "--json", *(settle or stages)], capture_output=True, text=True, check=True)
        moved = [stage for stage, entries in (json.loads(status.stdout or "{}")).items()
                 if all(isinstance(e, dict) and set(e) == {"changed deps"} and set(e["changed deps"]) == {live_file}
                        for e in entries)]
        if moved:
            subprocess.run([*dvc, "commit", "--force", *moved], check=True, capture_output=True)
            print(f"runs: {moved} recorded with the routing this cycle's promotion made live")
    return 0


def dvc_status(effective: Path, stages: list[str]) -> int:
    """``dvc status STAGES`` as the run's values see them."""
    with run_inputs(effective):
        return subprocess.run([sys.executable, "-m", "dvc", "status", *stages], check=False).returncode


def commit_lock(effective: Path, stages: list[str], live_file: str | None = None) -> None:
    """``dvc commit --force STAGES`` with the run's inputs standing in (``run_inputs``)."""
    with run_inputs(effective, live_file):
        subprocess.run([sys.executable, "-m", "dvc", "commit", "--force", *stages], check=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["open", "close", "fail", "times", "commit-lock", "repro", "status", "outputs"])
    parser.add_argument("--write-params", action="store_true",
                        help="open: write the run's effective params to .runs/<run id>/params.yaml")
    parser.add_argument("--stages", nargs="*", default=[], help="commit-lock: the stages whose outputs this run produced; "
                        "repro: the stages to reproduce with the run's params")
    parser.add_argument("--single-item", action="store_true", help="repro: these stages only, not what they depend on")
    parser.add_argument("--settle", nargs="*", default=None, help="repro: the stages to record with the live routing "
                        "these stages moved, where it is their only change (default: the stages reproduced)")
    parser.add_argument("--task", default=None, help="fail: the task that failed")
    parser.add_argument("--error", default="", help="fail: why")
    parser.add_argument("--try-number", type=int, default=None)
    parser.add_argument("--run-id", default=None, help="pipeline run id (default: $PIPELINE_RUN_ID or a new one)")
    parser.add_argument("--status", default="FINISHED", choices=["FINISHED", "FAILED", "KILLED"])


# whole Params: every kind of learning's section (Params.learners), the registry's models, tracking and serving
def outputs(params: Params) -> list[str]:
    """The run summary's lines for what each role's training stage wrote, what is registered and what is served: derived
    from the params, so a role or a kind of learning added there is listed here too."""
    from pipeline import training  # noqa: PLC0415 - only this action needs the trainers' file layout
    from pipeline.services.mlflow_server import tracking_uri  # noqa: PLC0415 - as above

    learners = [(training.files(kind, role), getattr(params, kind.value).roles[role].out_dir)
                for kind, roles in params.learners().items() for role in roles]
    width = max(len(f.stage) for f, _ in learners)
    lines = [f"  {f.stage:<{width}}  {out_dir}/ ; {f.report}, curves {f.plots}/" for f, out_dir in learners]
    proxy = params.serving.proxy
    return [*lines, f"  {'(GPU: the RL trace store)':<{width}}  {params.ppo.agl.trace_dir}/ (Agent Lightning's)",
            f"  registry        {tracking_uri(params.mlflow)}/#/models  ({', '.join(params.promote.roles)}: aliases "
            "champion/challenger); prompts: its Prompt Registry, society.<template>",
            f"  serving         LLM proxy http://{proxy.host}:{proxy.port}/v1 (roles: {' '.join(params.serving.roles)}; "
            f"key in {proxy.key_file}), routing: python -m pipeline route status ; logs {params.serving.home}/"]


def _parent(args: argparse.Namespace, mlflow: MlflowParams, live_file: str, run_key: str) -> str:
    """The pipeline run's MLflow parent run; ``open`` first brings back what a killed run left standing in, and with
    ``--write-params`` logs the run's effective params on it."""
    if args.action == "open" and (restored := restore_stood_in()):
        print(f"runs: restored {restored} left standing in by a process that was killed", file=sys.stderr)
    mlflow_run = tracking.parent_run(mlflow)
    if args.action == "open" and args.write_params:
        from mlflow import MlflowClient  # noqa: PLC0415 - 1.3 s import; the DAG's tasks import this module for effective_file

        path = write_effective(args.params_path, run_key, live_file)
        MlflowClient().log_artifact(mlflow_run, str(path), "params")
    return mlflow_run


def main(args: argparse.Namespace, params: Params) -> int:
    if args.action == "outputs":
        print("\n".join(outputs(params)))
        return 0
    if args.run_id:
        os.environ[tracking.RUN_ID_ENV] = args.run_id
    run_key = tracking.pipeline_run_id()
    with_params = {"repro": lambda e: repro(e, args.stages, args.single_item, params.serving.live_file, args.settle),
                   "status": lambda e: dvc_status(e, args.stages)}
    if args.action in with_params:  # check() found the run's effective params
        return with_params[args.action](effective_file(run_key))
    if args.action == "commit-lock":
        effective = Path(args.params_path) if args.params_path else effective_file(run_key)
        commit_lock(effective, args.stages, params.serving.live_file)
        print(f"dvc.lock: {len(args.stages)} stage(s) committed with the params of {effective}")
        return 0
    mlflow_run = _parent(args, params.mlflow, params.serving.live_file, run_key)
    if args.action == "close":
        tracking.finish_parent(params.mlflow, args.status)
    if args.action == "times":
        for stage, seconds in tracking.stage_times(params.mlflow):
            print(f"  {stage:<18} {seconds / 60:5.1f} min")
        return 0
    if args.action == "fail":
        tracking.record_failure(params.mlflow, args.task, args.error, args.try_number)
    print(f"{run_key} {mlflow_run} {tracking.experiment_id(params.mlflow)}")
    return 0
