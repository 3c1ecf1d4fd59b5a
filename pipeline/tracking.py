"""MLflow runs for stages: one child run per stage under one parent run per pipeline run.

The pipeline run id comes from ``PIPELINE_RUN_ID`` (set by ``make run`` and by the DAG to Airflow's
run id), so stages started as separate processes by DVC or Airflow land under the same parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

from pipeline import timing
from pipeline.config import MlflowParams
from pipeline.services import mlflow_server

RUN_ID_ENV = "PIPELINE_RUN_ID"
RUN_TAG = "pipeline.run_id"
# what every run and registered version of this process was produced under (the CLI sets data.setting): a version
# trained or evaluated in one PubMedQA setting is never read as the other's
CONTEXT: dict[str, str] = {}
# mlflow is imported inside the functions that use it: a 1.3 s import, and the model plane (which runs stage
# modules that import this one) has no mlflow. Functions given the ``mlflow`` section import the names they call.


def pipeline_run_id() -> str:
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        run_id = f"adhoc-{uuid.uuid4().hex[:8]}"
        os.environ[RUN_ID_ENV] = run_id
    return run_id


# MLflow's switches for moving artifacts by presigned URL instead of through the server (unset: the server decides)
PRESIGNED_ENV = ("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD")


def setup(mlflow: MlflowParams) -> str:
    """Point the MLflow client at the tracking server and the experiment. It starts nothing: the command's entry point
    started the local server (``pipeline/cli.py``); a server that is not up is a one-line error.

    Also decides how this process moves artifacts (``mlflow.presigned_urls``). A server that proxies an S3 store
    advertises presigned downloads (MLflow >= 3.17; uploads from 500 MB), and its clients then GET the store directly.
    Our stores admit only the server: Kubernetes' minio-ingress policy leaves out the rollout Jobs, which load the
    supervisor's policy, and make prod-stack's S3 refuses presigned URLs. Left to the server, every such download fails
    after minutes of retries."""
    from mlflow import set_experiment, set_tracking_uri  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    for name in PRESIGNED_ENV:
        os.environ[name] = "true" if mlflow.presigned_urls else "false"
    # MLflow reads these at every request: every tracking and registry call of this process gets them
    os.environ.update({"MLFLOW_HTTP_REQUEST_TIMEOUT": str(mlflow.request_timeout_s),
                       "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(mlflow.request_retries),
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"})
    # "Waiting up to 300 seconds for ... version to finish creation", once for every version and prompt registered
    # (ten lines a `make run`); a version that does not become ready still raises
    logging.getLogger("mlflow.store.model_registry.abstract_store").setLevel(logging.WARNING)
    with timing.phase(timing.Phase.TRACKING):
        uri = mlflow_server.connect(mlflow)
        set_tracking_uri(uri)
        set_experiment(mlflow.experiment)
    return uri


def unreachable(exc: BaseException) -> str | None:
    """One line for an error that means the tracking server did not answer (refused, reset, timed out, retries spent),
    else None: a stage whose server died ends naming it instead of in a traceback."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        kind = f"{type(seen).__module__}.{type(seen).__name__}"
        if kind.startswith(("requests.exceptions.", "urllib3.exceptions.")) or (
                "API request to" in text and ("Max retries exceeded" in text or "timed out" in text.lower())):
            from mlflow import get_tracking_uri  # noqa: PLC0415 - loaded already: the error came from it

            text = " ".join(text.split())
            cause = text[text.rfind("Caused by"):] if "Caused by" in text else text  # refused, reset or timed out
            return f"the MLflow tracking server {get_tracking_uri()} did not answer ({cause[:200]})"
        seen = seen.__cause__ or seen.__context__
    return None


def run_url(run_id: str) -> str:
    """The run's page in the MLflow UI (what a version's ``eval.run_url`` tag links to)."""
    from mlflow import MlflowClient, get_tracking_uri  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    experiment = MlflowClient().get_run(run_id).info.experiment_id
    return f"{get_tracking_uri().rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def experiment_id(mlflow: MlflowParams) -> str:
    """The pipeline experiment's id (``setup`` creates it); a clear error if it is gone."""
    from mlflow import get_experiment_by_name, get_tracking_uri  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    exp = get_experiment_by_name(mlflow.experiment)
    if exp is None:
        raise RuntimeError(f"MLflow experiment {mlflow.experiment!r} not found at {get_tracking_uri()}")
    return str(exp.experiment_id)


def parent_run(mlflow: MlflowParams) -> str:
    """Find or create the parent run of the current pipeline run; returns its MLflow run id."""
    from mlflow import MlflowClient, search_runs  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    setup(mlflow)
    run_key = pipeline_run_id()
    exp_id = experiment_id(mlflow)
    found = search_runs(
        [exp_id],
        filter_string=f"tags.`{RUN_TAG}` = '{run_key}' and tags.`pipeline.kind` = 'parent'",
        output_format="list",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    client = MlflowClient()
    run = client.create_run(exp_id, run_name=f"pipeline-{run_key}", tags={RUN_TAG: run_key, "pipeline.kind": "parent"})
    return run.info.run_id


@contextlib.contextmanager
def stage_run(stage: str, mlflow: MlflowParams, tags: dict[str, str] | None = None) -> Iterator[Any]:
    """Open the stage's child run; the parent is only referenced, never ended, by a stage."""
    from mlflow import start_run  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    os.environ[timing.STAGE_ENV] = stage  # the model plane this stage starts records under it too
    timing.record(timing.Phase.STARTUP, timing.startup())
    with timing.phase(timing.Phase.TRACKING):
        parent_id = parent_run(mlflow)
    run_tags = {RUN_TAG: pipeline_run_id(), "pipeline.kind": "stage", "pipeline.stage": stage,
                "mlflow.parentRunId": parent_id, **CONTEXT, **(tags or {})}
    try:
        with start_run(run_name=stage, tags=run_tags) as run:
            yield run
    finally:
        timing.record(timing.Phase.STAGE, timing.since_process_start())


def finish_parent(mlflow: MlflowParams, status: str = "FINISHED") -> None:
    from mlflow import MlflowClient  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    MlflowClient().set_terminated(parent_run(mlflow), status=status)


def stage_times(mlflow: MlflowParams) -> list[tuple[str, float]]:
    """(stage, seconds) of the current pipeline run's stage runs, in start order."""
    from mlflow import MlflowClient  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    setup(mlflow)
    runs = MlflowClient().search_runs(
        [experiment_id(mlflow)], f"tags.`{RUN_TAG}` = '{pipeline_run_id()}' and tags.`pipeline.kind` = 'stage'", max_results=500)
    done = sorted((r for r in runs if r.info.end_time), key=lambda r: r.info.start_time)
    return [(r.data.tags.get("pipeline.stage", r.info.run_name), (r.info.end_time - r.info.start_time) / 1000) for r in done]


def record_failure(mlflow: MlflowParams, task: str, error: str, try_number: int | None = None) -> str:
    """Note a failed orchestrator task on the parent run: ``failed.<task>`` tag + the list in ``failed_tasks``."""
    from mlflow import MlflowClient  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    client = MlflowClient()
    parent = parent_run(mlflow)
    run = client.get_run(parent)
    failed = [t for t in run.data.tags.get("failed_tasks", "").split(",") if t]
    client.set_tag(parent, "failed_tasks", ",".join(dict.fromkeys([*failed, task])))
    client.set_tag(parent, f"failed.{task}", f"try {try_number}: {error}"[:4000] if try_number else error[:4000])
    return parent


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k.replace("/", "."): float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_training(config: dict[str, Any], history: list[dict[str, Any]], metrics: dict[str, Any],
                 plot: str | os.PathLike[str]) -> None:
    """What every trainer logs to its stage run: its config, the trainer's per-step history as metric
    curves, the stage's summary metrics and its curve plot (so runs of different trainers compare alike)."""
    import mlflow  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    mlflow.log_params(config)
    for h in history:
        if vals := _numeric({k: v for k, v in h.items() if k != "step"}):
            mlflow.log_metrics(vals, step=int(h["step"]))
    mlflow.log_metrics(_numeric(metrics))
    mlflow.log_artifact(str(plot), artifact_path="plots")


def tag_no_signal(reason: str) -> None:
    """Mark the active run: its trainer's data carried no signal (the reason says why), so nothing was registered."""
    import mlflow  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    mlflow.set_tags({"no_signal": "true", "no_signal_reason": reason[:4000]})


def record_no_signal(stage: str, mlflow: MlflowParams, reason: str, report: str | os.PathLike[str]) -> None:
    """The stage's MLflow run for a cycle whose data carried no signal: tagged with the reason, the report attached,
    nothing registered (so there is no challenger for `evaluate` to spend rollouts on)."""
    from mlflow import log_artifact  # noqa: PLC0415 - 1.3 s, control plane only (see top)

    with stage_run(stage, mlflow):
        tag_no_signal(reason)
        log_artifact(str(report))
