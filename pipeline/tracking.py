"""MLflow runs for stages: one child run per stage under one parent run per pipeline run.

The pipeline run id comes from ``PIPELINE_RUN_ID`` (set by ``make run`` and by the DAG to Airflow's
run id), so stages started as separate processes by DVC or Airflow land under the same parent.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

from pipeline.config import Params

RUN_ID_ENV = "PIPELINE_RUN_ID"
RUN_TAG = "pipeline.run_id"


def pipeline_run_id() -> str:
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        run_id = f"adhoc-{uuid.uuid4().hex[:8]}"
        os.environ[RUN_ID_ENV] = run_id
    return run_id


def setup(params: Params) -> str:
    """Point the MLflow client at the tracking server (starting the local one) and the experiment."""
    import mlflow

    from pipeline.services import mlflow_server

    uri = mlflow_server.ensure(params)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(params.mlflow.experiment)
    return uri


def experiment_id(params: Params) -> str:
    """The pipeline experiment's id (``setup`` creates it); a clear error if it is gone."""
    import mlflow

    exp = mlflow.get_experiment_by_name(params.mlflow.experiment)
    if exp is None:
        raise RuntimeError(f"MLflow experiment {params.mlflow.experiment!r} not found at {mlflow.get_tracking_uri()}")
    return str(exp.experiment_id)


def parent_run(params: Params) -> str:
    """Find or create the parent run of the current pipeline run; returns its MLflow run id."""
    import mlflow

    setup(params)
    run_key = pipeline_run_id()
    exp_id = experiment_id(params)
    found = mlflow.search_runs(
        [exp_id],
        filter_string=f"tags.`{RUN_TAG}` = '{run_key}' and tags.`pipeline.kind` = 'parent'",
        output_format="list",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    client = mlflow.MlflowClient()
    run = client.create_run(exp_id, run_name=f"pipeline-{run_key}", tags={RUN_TAG: run_key, "pipeline.kind": "parent"})
    return run.info.run_id


@contextlib.contextmanager
def stage_run(stage: str, params: Params, tags: dict[str, str] | None = None) -> Iterator[Any]:
    """Open the stage's child run; the parent is only referenced, never ended, by a stage."""
    import mlflow

    parent_id = parent_run(params)
    run_tags = {RUN_TAG: pipeline_run_id(), "pipeline.kind": "stage", "pipeline.stage": stage,
                "mlflow.parentRunId": parent_id, **(tags or {})}
    with mlflow.start_run(run_name=stage, tags=run_tags) as run:
        yield run


def finish_parent(params: Params, status: str = "FINISHED") -> None:
    import mlflow

    client = mlflow.MlflowClient()
    client.set_terminated(parent_run(params), status=status)


def stage_times(params: Params) -> list[tuple[str, float]]:
    """(stage, seconds) of the current pipeline run's stage runs, in start order."""
    import mlflow

    setup(params)
    runs = mlflow.MlflowClient().search_runs(
        [experiment_id(params)], f"tags.`{RUN_TAG}` = '{pipeline_run_id()}' and tags.`pipeline.kind` = 'stage'", max_results=500)
    done = sorted((r for r in runs if r.info.end_time), key=lambda r: r.info.start_time)
    return [(r.data.tags.get("pipeline.stage", r.info.run_name), (r.info.end_time - r.info.start_time) / 1000) for r in done]


def record_failure(params: Params, task: str, error: str, try_number: int | None = None) -> str:
    """Note a failed orchestrator task on the parent run: ``failed.<task>`` tag + the list in ``failed_tasks``."""
    import mlflow

    client = mlflow.MlflowClient()
    parent = parent_run(params)
    run = client.get_run(parent)
    failed = [t for t in run.data.tags.get("failed_tasks", "").split(",") if t]
    client.set_tag(parent, "failed_tasks", ",".join(dict.fromkeys([*failed, task])))
    client.set_tag(parent, f"failed.{task}", f"try {try_number}: {error}"[:4000] if try_number else error[:4000])
    return parent


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k.replace("/", "."): float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_training(config: dict[str, Any], history: list[dict[str, Any]], metrics: dict[str, Any], plot: str | os.PathLike[str]) -> None:
    """What every trainer logs to its stage run: its config, the trainer's per-step history as metric
    curves, the stage's summary metrics and its curve plot (so runs of different trainers compare alike)."""
    import mlflow

    mlflow.log_params(config)
    for h in history:
        if vals := _numeric({k: v for k, v in h.items() if k != "step"}):
            mlflow.log_metrics(vals, step=int(h["step"]))
    mlflow.log_metrics(_numeric(metrics))
    mlflow.log_artifact(str(plot), artifact_path="plots")


def tag_no_signal(reason: str) -> None:
    """Mark the active run: its trainer's data carried no signal (the reason says why), so nothing was registered."""
    import mlflow

    mlflow.set_tags({"no_signal": "true", "no_signal_reason": reason[:4000]})


def record_no_signal(stage: str, params: Params, reason: str, report: str | os.PathLike[str]) -> None:
    """The stage's MLflow run for a cycle whose data carried no signal: tagged with the reason, the report attached,
    nothing registered (so there is no challenger for `evaluate` to spend rollouts on)."""
    import mlflow

    with stage_run(stage, params):
        tag_no_signal(reason)
        mlflow.log_artifact(str(report))
