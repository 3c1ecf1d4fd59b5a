"""Retraining loop of the PubMedQA research society.

Each task calls the same CLI entry point as ``dvc.yaml`` (``python -m pipeline <stage>``) in the
project checkout, under one MLflow parent run named after the Airflow run id. A failed
expectation in ``validate`` fails the run without retries (it is not transient) and nothing
downstream runs. The last task records the outputs with DVC (commit + push) so an Airflow run is
versioned exactly like ``dvc repro``: stages themselves never touch DVC, because DVC's repo lock
forbids concurrent DVC commands in one checkout.

Only the standard library and ``airflow.sdk`` are imported at parse time: the ``pipeline`` imports stay inside the
task callables, because Airflow re-parses this file continuously.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pendulum
import yaml
from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import Asset, Param, TaskGroup, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.timetables.assets import AssetOrTimeSchedule
from airflow.timetables.trigger import CronTriggerTimetable

from pipeline.learning import WAYS, Learning, candidate_key, learners  # standard library only: cheap to parse

PROJECT_ROOT = Path(os.environ.get("PIPELINE_ROOT", Path(__file__).resolve().parent.parent))

GPU_POOL = "gpu"  # created by `python -m pipeline services up airflow`; size it to the GPU workers in production
# GPU-bound tasks: the `gpu` Celery queue (docker-compose, `make prod-stack`), and under the KubernetesExecutor a
# pod from this template (infra/k8s/pod-template-gpu.yaml: nvidia.com/gpu, the GPU image); other executors ignore it.
GPU: dict[str, Any] = {"queue": "gpu", "executor_config": {"pod_template_file": os.environ.get(
    "PIPELINE_GPU_POD_TEMPLATE", "/opt/airflow/pod_templates/pod-template-gpu.yaml")}}
# Who learns how, read from params.yaml when Airflow parses this file: one task per kind of learning, mapped over the
# roles of its `<kind>.roles` (a role added there is a mapped instance here on the next parse, as `dvc.yaml`'s foreach).
RAW_PARAMS = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text()) or {}
LEARNERS = learners(RAW_PARAMS)
STAGES = ["ingest", "validate", "materialize_model", "build_index", "rollouts", "datasets",
          *(f"{kind.stage}@{role}" for kind, names in LEARNERS.items() for role in names), "evaluate", "promote", "report"]


def _asks_a_person(role: str) -> bool:
    """The role's gate values (``roles.<role>.gate``, else ``promote``) say ``approval: required``."""
    gate = ((RAW_PARAMS.get("roles") or {}).get(role) or {}).get("gate") or {}
    return gate.get("approval", (RAW_PARAMS.get("promote") or {}).get("approval", "none")) == "required"


# The candidates a person approves before they are switched in: one approval task each (params.yaml at parse time, as
# LEARNERS), keyed as promotion keys them (reports/promotion.json)
APPROVALS = [candidate_key(kind, role) for kind, names in LEARNERS.items() for role in names if _asks_a_person(role)]
APPROVAL_TIMEOUT = timedelta(hours=float((RAW_PARAMS.get("promote") or {}).get("approval_timeout_h", 72)))

# Whoever refreshes the source data emits an event on this asset (a producer DAG with
# ``outlets=[SOURCE_DATA]``, or ``POST /api/v2/assets/events``): the loop then runs without waiting for Monday.
SOURCE_DATA = Asset(name="pubmedqa_source_data", uri=os.environ.get("PIPELINE_SOURCE_ASSET_URI", "pubmedqa://pqa-l/source"))

# UI-triggered run Params -> the PIPELINE__ overrides every stage's load_params() reads (None = params.yaml)
RUN_PARAMS = {
    "shards": "PIPELINE__ROLLOUTS__SHARDS",
    "tasks": "PIPELINE__ROLLOUTS__LIMIT",
    "samples_per_task": "PIPELINE__ROLLOUTS__SAMPLES_PER_TASK",
    "eval_limit": "PIPELINE__EVALUATE__LIMIT",
    "margin": "PIPELINE__PROMOTE__MARGIN",
    "dry_run": "PIPELINE__PROMOTE__DRY_RUN",
}
TRAINERS = [kind.value for kind in Learning]  # the `trainers` Param: which kinds of learning a run runs


def _apply_run_params(ctx: Any) -> None:
    """Point this process at the project, the pipeline run and the run's Param overrides."""
    from pipeline.config import allowed_params_file  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

    os.chdir(PROJECT_ROOT)
    os.environ["PIPELINE_RUN_ID"] = re.sub(r"[^A-Za-z0-9_.-]", "_", ctx["run_id"])
    params = ctx["params"]
    allowed_params_file(params["params_file"], PROJECT_ROOT)  # refuses anything but the repo's params files
    if params.get("data_source"):
        os.environ["PIPELINE__DATA__SOURCE"] = params["data_source"]
    for name, env in RUN_PARAMS.items():
        value = params.get(name)
        if value is not None:
            os.environ[env] = str(value).lower() if isinstance(value, bool) else str(value)


def _params_file(ctx: Any) -> str:
    """The file every task of this run reads: the run's effective params (written by `open_run` from the params
    file and the run's Params, logged on the MLflow run), so every stage, MLflow and dvc.lock see the same values."""
    from pipeline.runs import effective_file  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

    path = effective_file(os.environ["PIPELINE_RUN_ID"])
    return str(path) if (PROJECT_ROOT / path).exists() else ctx["params"]["params_file"]


def _record_failure(context: Any) -> None:
    """on_failure_callback: the failed task (and why) on the MLflow parent run; never raises."""
    ti = context["ti"]
    try:
        _apply_run_params(context)
        from pipeline.cli import main  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

        main(["--params", context["params"]["params_file"], "run", "fail", "--task", ti.task_id,
              "--error", repr(context.get("exception"))[:2000], "--try-number", str(ti.try_number)])
    except Exception as exc:
        print(f"could not record the failure of {ti.task_id} in MLflow: {exc}")


GROUP_DOCS = {
    "prepare": "**prepare**: ingest PubMedQA PQA-L, validate it with great-expectations (a failed expectation fails "
               "the run, no retry), materialise the base model for the vLLM workers, build the tools' BM25 index.",
    "collect": "**collect**: the society on the train split in mapped shards (`shards` Param), traces into the DVC "
               "trace store, then the per-role training data (`datasets`).",
    "train": "**train**: one task per kind of learning, mapped over the roles that learn by it (`<kind>.roles` in "
             "params.yaml): " + "; ".join(f"`{k.stage}` ({w.doc})" for k, w in WAYS.items())
             + ". Each instance registers its role's `challenger` in MLflow. The `trainers` Param picks which kinds "
             "run; the others are skipped.",
    "decide": "**decide**: each challenger against its champion on the validation split (`eval_limit`), the "
              "judge-gated promotion (`margin`, `dry_run`), a person's approval where the role's gate asks for one "
              "(`approve_<candidate>`: the evidence, Approve or Reject), the decision printed by `promotion_gate`, and "
              "the test split report when a champion changed.",
    "record": "**record**: `dvc commit` + `dvc push` of what ran, then the MLflow parent run closed as FINISHED or FAILED.",
}


def _train(kind: Learning, role: str) -> None:
    if kind.value not in get_current_context()["params"]["trainers"]:
        raise AirflowSkipException(f"trainer {kind.value!r} is not in this run's `trainers` Param")
    _run_stage(kind.command, "--role", role)


DEFAULT_ARGS = {
    "owner": "ml-platform",
    "on_failure_callback": _record_failure,
    "retries": 2,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": True,
    "execution_timeout": timedelta(hours=2),
}


def _run_stage(stage: str, *extra: str) -> None:
    """Run one pipeline stage in-process through the CLI, from the project root."""
    ctx = get_current_context()
    _apply_run_params(ctx)
    from pipeline.cli import main  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

    rc = main(["--params", _params_file(ctx), stage, *extra])
    if rc == 1 and stage == "validate":
        raise AirflowFailException("validation failed: see the task log and reports/validation/")
    if rc != 0:
        raise RuntimeError(f"stage {stage} exited with {rc}")


@dag(
    dag_id="agent_retraining",
    description="Self-improvement loop of the PubMedQA research society",
    # weekly (Monday 03:00 UTC), or as soon as the source data is updated
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 3 * * 1", timezone="UTC"),
                                 assets=[SOURCE_DATA]),  # type: ignore[list-item]  # the SDK Asset is serialized on parse
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    doc_md=__doc__,
    tags=["society", "retraining", "pubmedqa"],
    params={
        "params_file": Param("params.yaml", type="string", description="params file, relative to the project root"),
        "data_source": Param(None, type=["null", "string"],
                             description="override data.source: path, hf://id, http(s):// or s3:// (empty = params.yaml)"),
        "shards": Param(None, type=["null", "integer"], minimum=1,
                        description="rollout shards (mapped tasks); empty = rollouts.shards"),
        "tasks": Param(None, type=["null", "integer"], minimum=1,
                       description="train questions rolled out; empty = rollouts.limit"),
        "samples_per_task": Param(None, type=["null", "integer"], minimum=1,
                                  description="rollouts per question (the GRPO/SFT group)"),
        "trainers": Param(TRAINERS, type="array", items={"type": "string", "enum": TRAINERS},
                          description="which kinds of learning run: " + "; ".join(f"{k.value}: {w.doc}"
                                                                                   for k, w in WAYS.items())),
        "eval_limit": Param(None, type=["null", "integer"], minimum=1, description="validation questions per model compared"),
        "margin": Param(None, type=["null", "number"], minimum=0,
                        description="reward margin a challenger must beat its champion by"),
        "dry_run": Param(None, type=["null", "boolean"], description="true: evaluate and decide, never promote"),
    },
)
def agent_retraining() -> None:
    @task
    def open_run() -> str:
        _run_stage("run", "open", "--write-params")  # the run's effective params file: what every later task reads
        return os.environ["PIPELINE_RUN_ID"]

    @task
    def ingest() -> None:
        _run_stage("ingest")

    @task
    def validate() -> None:
        _run_stage("validate")

    @task(**GPU)
    def preflight_gpu() -> None:
        """`preflight gpu` on the GPU worker itself: the verl config composes, the devices fit, routing names served
        models, every GPU package imports; a CPU profile (no GPU stage said) passes with nothing to check."""
        _run_stage("preflight", "gpu", "--imports", "--if-gpu")

    @task(**GPU, pool_slots=1)
    def materialize_model() -> None:
        """Base checkpoint -> HF folder for the vLLM workers (model plane; `gpu` queue in production)."""
        _run_stage("materialize-model")

    @task
    def build_index() -> None:
        _run_stage("build-index")

    @task
    def shard_ids() -> list[int]:
        from pipeline.config import load_params  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

        ctx = get_current_context()
        _apply_run_params(ctx)  # the `shards` Param, if set, decides how many mapped tasks there are
        return list(range(load_params(_params_file(ctx)).rollouts.shards))

    @task(**GPU, max_active_tis_per_dagrun=2, map_index_template="shard {{ task.op_kwargs['shard'] }}")
    def rollouts(shard: int) -> None:
        """One shard of the train split; each mapped task writes only its own shard file."""
        _run_stage("rollouts", "--shard", str(shard))

    @task
    def rollout_metrics() -> None:
        _run_stage("rollouts", "--collect")

    @task
    def datasets() -> None:
        """Traces -> SFT chat data (juniors), RL prompts (seniors), logged decisions (supervisor)."""
        _run_stage("datasets")

    def trainer(kind: Learning) -> Any:
        """The kind's task, mapped over its roles (one instance per `train_<kind>@<role>` DVC stage)."""
        way = WAYS[kind]
        queue = {**GPU, **({"pool": GPU_POOL, "pool_slots": 1} if way.pool else {})} if way.gpu else {}

        @task(task_id=kind.stage, execution_timeout=timedelta(hours=way.timeout_h),
              map_index_template="{{ task.op_kwargs['role'] }}", doc_md=f"{kind.stage}: {way.doc}", **queue)
        def train(role: str) -> None:
            _train(kind, role)

        return train.expand(role=LEARNERS[kind])

    @task(**GPU, trigger_rule="none_failed_min_one_success")  # a trainer left out by the `trainers` Param is skipped
    def evaluate() -> None:
        """Each role's challenger vs its champion on the validation split (MLflow GenAI evaluation)."""
        _run_stage("evaluate")

    @task(**GPU)
    def promote() -> None:
        """The gate: promote a candidate that beat its champion (hot-load, routing version, alias)."""
        _run_stage("promote")

    def approval(key: str) -> Any:
        """A candidate that passed the gate and whose role asks a person: the evidence shown in the Airflow UI's
        approval form; the answer (or the timeout's Reject) finishes it through `promote --approve/--reject`."""
        name = re.sub(r"[^A-Za-z0-9_]", "_", key)

        @task.short_circuit(task_id=f"awaits_{name}", ignore_downstream_trigger_rules=False)
        def awaits() -> str | None:
            from pipeline.stages.promote import approval_request  # noqa: PLC0415 - task-only: Airflow re-parses this file

            os.chdir(PROJECT_ROOT)
            return approval_request(key)  # None: not awaiting (refused, or no candidate): the approval task is skipped

        ask = HITLOperator(task_id=f"approve_{name}", subject=f"Switch in {key}?", options=["Approve", "Reject"],
                           defaults=["Reject"], response_timeout=APPROVAL_TIMEOUT,
                           body="{{ ti.xcom_pull(task_ids='awaits_" + name + "') }}")

        @task(task_id=f"answer_{name}")
        def answer() -> None:
            got = get_current_context()["ti"].xcom_pull(task_ids=f"approve_{name}") or {}
            who = (got.get("responded_by_user") or {}).get("name")
            if got.get("chosen_options") == ["Approve"] and who:
                _run_stage("promote", "--approve", key, "--by", who)
            else:
                why = "rejected in Airflow" if who else f"no answer within {APPROVAL_TIMEOUT}"
                _run_stage("promote", "--reject", key, "--by", who or "airflow (timeout)", "--why", why)

        first, last = awaits(), answer()
        first >> ask >> last
        return first, last

    @task.branch(trigger_rule="none_failed")  # after the approvals: the skipped ones (nothing awaited) are fine
    def promotion_gate() -> str:
        """Branch on the decision: the champion is reported on the test split only when it changed."""
        from pipeline.contracts import PromotionReport, read  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

        result = read(PromotionReport, PROJECT_ROOT / "reports/promotion.json")
        print("\n".join(result.lines()))  # each decision, the champions, the live routing version
        try:  # where to look: the pipeline run's parent run in MLflow (its children are the stage runs)
            from pipeline import tracking  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously
            from pipeline.config import load_params  # noqa: PLC0415 - task-only: Airflow re-parses this file continuously

            ctx = get_current_context()
            _apply_run_params(ctx)
            params = load_params(_params_file(ctx))
            uri, parent = tracking.setup(params.mlflow), tracking.parent_run(params.mlflow)

            print(f"MLflow: {uri}/#/experiments/{tracking.experiment_id(params.mlflow)}/runs/{parent}")
        except Exception as exc:
            print(f"MLflow link unavailable: {exc}")
        return "report" if result.promoted else "not_promoted"

    @task(**GPU)
    def report() -> None:
        """The champion society on the official test split (the only reader of the test split)."""
        _run_stage("report")

    @task
    def not_promoted() -> None:
        """No candidate beat its champion: nothing changed in the registry or the routing."""

    @task(retries=1, trigger_rule="none_failed_min_one_success")
    def version_outputs() -> None:
        """Record the stage outputs in dvc.lock and push them to the DVC remote."""
        ctx = get_current_context()
        # whether `report` ran, from its task state (the branch's XCom shape differs across Airflow versions)
        reported = ctx["ti"].get_ti_count(dag_id=ctx["dag"].dag_id, task_ids=["report"], run_ids=[ctx["run_id"]],
                                          states=["success"]) > 0
        kinds = {Learning(t).stage for t in TRAINERS if t not in ctx["params"]["trainers"]}
        stages = [s for s in STAGES if s.partition("@")[0] not in kinds and (reported or s != "report")]
        _run_stage("run", "commit-lock", "--stages", *stages)  # dvc.lock records the values this run used
        subprocess.run([sys.executable, "-m", "dvc", "push"], cwd=PROJECT_ROOT, check=True)

    @task
    def close_run() -> None:
        """Mark the MLflow parent run FINISHED or FAILED, whatever happened upstream (a teardown: it
        always runs once `open_run` did, and does not decide the DAG run's state)."""
        ctx = get_current_context()
        failed = ctx["ti"].get_ti_count(dag_id=ctx["dag"].dag_id, run_ids=[ctx["run_id"]],
                                        states=["failed", "upstream_failed"])
        _run_stage("run", "close", "--status", "FAILED" if failed else "FINISHED")

    run = open_run()
    with TaskGroup("prepare", prefix_group_id=False, tooltip="data and model", doc_md=GROUP_DOCS["prepare"]):
        validated = run >> ingest() >> validate()
        model = run >> preflight_gpu() >> materialize_model()
        index = validated >> build_index()
    with TaskGroup("collect", prefix_group_id=False, tooltip="rollouts -> training data", doc_md=GROUP_DOCS["collect"]):
        shards = rollouts.expand(shard=shard_ids())
        [index, model] >> shards
        data = shards >> rollout_metrics() >> datasets()
    with TaskGroup("train", prefix_group_id=False, tooltip="one trainer per role", doc_md=GROUP_DOCS["train"]):
        trained = []
        for kind, way in WAYS.items():
            t = trainer(kind)
            if way.after == "datasets":
                data >> t
            else:  # gold labels, or the served champion on train questions: it waits for no rollout
                [validated, model] >> t
            trained.append(t)
    with TaskGroup("decide", prefix_group_id=False, tooltip="evaluate, promote, report", doc_md=GROUP_DOCS["decide"]):
        decided = trained >> evaluate() >> promote()
        gate = promotion_gate()
        for key in APPROVALS:
            first, last = approval(key)
            decided >> first
            last >> gate
        if not APPROVALS:
            decided >> gate
        branches = gate >> [report(), not_promoted()]
    with TaskGroup("record", prefix_group_id=False, tooltip="DVC + MLflow bookkeeping", doc_md=GROUP_DOCS["record"]):
        closed = branches >> version_outputs() >> close_run()
        closed.as_teardown(setups=run)

agent_retraining()
