"""The one sequence every training stage runs, as TRL's trainers fix theirs.

inputs (fail fast, before torch or services; or a reason the data cannot carry signal) -> train (in the model plane,
or here for a trainer that needs no torch) -> metrics with their signal -> register the version with its lineage as the
role's challenger, or nothing when the signal was not there. A stage describes its steps in a :class:`Trainer`; this
module runs them in that order for every stage, with the same MLflow run, reports and messages.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import contracts, envs, metrics_files, timing, tracking
from pipeline.config import Params
from pipeline.contracts import TrainerReport
from pipeline.io import write_json
from pipeline.learning import Learning


@dataclass(frozen=True)
class Files:
    """What one role's training stage writes beside its artifact: its report and its curves (DVC outputs)."""

    stage: str  # the DVC stage: train_<kind>@<role>
    report: Path  # reports/train_<kind>/<role>.json
    plots: Path  # reports/plots/train_<kind>/: <role>-<curve>.csv|png

    def curve(self, name: str, ext: str) -> Path:
        return self.plots / f"{self.stage.partition('@')[2]}-{name}.{ext}"


def files(kind: Learning, role: str) -> Files:
    return Files(f"{kind.stage}@{role}", Path("reports", kind.stage, f"{role}.json"), Path("reports/plots", kind.stage))


def role_argument(parser: argparse.ArgumentParser, kind: Learning) -> None:
    """``--role``: which of the kind's roles (``<kind>.roles``) this run trains; optional while it has just one."""
    parser.add_argument("--role", help=f"a role of {kind.value}.roles (required when it lists more than one)")
    parser.set_defaults(learning=kind)  # the CLI checks --role against the params before it starts any service


# whole Params: the kinds' sections are looked up by name (Params.learners)
def pick_role(params: Params, kind: Learning, role: str | None) -> str:
    names = params.learners()[kind]
    if role is None and len(names) == 1:
        return names[0]
    if role not in names:
        raise SystemExit(f"error: --role {role!r}: {kind.value}.roles in params.yaml lists {names}")
    return role


@dataclass(frozen=True)
class Trainer:
    stage: str  # the DVC stage and MLflow stage run: "train_sft@junior_researcher"
    command: str  # the CLI command the model plane runs: "train-sft"
    role: str  # the registered model the version becomes a challenger of
    report: Path  # reports/<kind stage>/<role>.json: the metrics, with no_signal and its reason
    inputs: Callable[[], str | None]  # raises on missing or bad inputs; returns why the data has no signal, or None
    no_signal: Callable[[str], int]  # the stage's outputs for a cycle without signal; nothing trained or registered
    train: Callable[[], dict[str, Any]]  # the training itself: the model plane's work, metrics out
    register: Callable[[dict[str, Any], Any], Any]  # control plane, in the stage's run: curves, lineage, the version or None
    summary: Callable[[dict[str, Any]], str]
    in_model_plane: bool = True  # False: ``train`` runs here (no torch: VW, or a driver of remote GPU workers)
    tags: dict[str, str] = field(default_factory=dict)  # on the stage's MLflow run
    uri: Callable[[Any], str] | None = None  # how a registered version is named (default models:/<role>/<version>)


def main(t: Trainer, args: argparse.Namespace, params: Params) -> int:
    """Run ``t``'s steps in order: the control plane's path, or, under ``--in-model-plane``, the training alone."""
    if getattr(args, "in_model_plane", False):  # said by the control plane that spawned us, never guessed
        import torch  # noqa: F401, PLC0415 - model plane only: the libraries every trainer loads count as its start-up
        import transformers  # noqa: F401, PLC0415 - as above

        timing.record(timing.Phase.STARTUP, timing.startup(), plane="model")
        return _train(t)
    try:  # fail fast, before paying for torch or services
        reason = t.inputs()
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if reason is not None:
        return t.no_signal(reason)
    argv = ((["--params", args.params_path] if getattr(args, "params_path", None) else [])
            + [t.command, "--in-model-plane", "--role", args.role])
    if args.no_mlflow:
        return envs.run_in_model_plane(argv) if t.in_model_plane else _train(t)
    with tracking.stage_run(t.stage, params.mlflow, tags=t.tags) as run:
        import mlflow  # noqa: PLC0415 - control plane only (the model plane, which imports the stages, has no mlflow)

        rc = envs.run_in_model_plane(argv) if t.in_model_plane else _train(t)
        if rc != 0:
            return rc
        report = contracts.read(TrainerReport, t.report)  # a report that breaks its contract: one line (the CLI's)
        metrics = report.model_dump()
        try:
            with timing.phase(timing.Phase.REGISTRY):
                version = t.register(metrics, mlflow.get_run(run.info.run_id))
                mlflow.log_artifact(str(t.report))
        except (FileNotFoundError, ValueError) as exc:  # the trained artifact stays; nothing half-registered is aliased
            print(f"error: {t.stage}: not registered: {exc}", file=sys.stderr)
            return 1
        if version is None:
            print(f"{t.stage}: no_signal, nothing registered: {report.no_signal_reason}")
        else:
            where = t.uri(version) if t.uri else f"models:/{t.role}/{version.version}"
            print(f"registered {t.role} version {version.version} ({where})")
    return 0


def _train(t: Trainer) -> int:
    try:
        metrics = t.train()
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_json(t.report, metrics)
    metrics_files.write(t.stage, metrics)
    print(t.summary(metrics))
    return 0
