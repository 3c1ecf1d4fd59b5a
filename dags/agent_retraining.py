"""Retraining loop of the PubMedQA research society.

Each task calls the same CLI entry point as ``dvc.yaml`` (``python -m pipeline <stage>``) in the
project checkout, under one MLflow parent run named after the Airflow run id. A failed
expectation in ``validate`` fails the run without retries (it is not transient) and nothing
downstream runs. The last task records the outputs with DVC (commit + push) so an Airflow run is
versioned exactly like ``dvc repro``: stages themselves never touch DVC, because DVC's repo lock
forbids concurrent DVC commands in one checkout.

Only the standard library and ``airflow.sdk`` are imported at parse time.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import Param, dag, task

PROJECT_ROOT = Path(os.environ.get("PIPELINE_ROOT", Path(__file__).resolve().parent.parent))

GPU_POOL = "gpu"  # created by `python -m pipeline services up airflow`; size it to the GPU workers in production
STAGES = ["ingest", "validate", "materialize_model", "build_index", "rollouts", "datasets", "train_sft", "train_ppo", "train_bandit",
          "evaluate", "promote", "report"]

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 2,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": True,
    "execution_timeout": timedelta(hours=2),
}


def _run_stage(stage: str, *extra: str) -> None:
    """Run one pipeline stage in-process through the CLI, from the project root."""
    import re

    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    os.chdir(PROJECT_ROOT)
    os.environ["PIPELINE_RUN_ID"] = re.sub(r"[^A-Za-z0-9_.-]", "_", ctx["run_id"])
    source = ctx["params"].get("data_source")
    if source:
        os.environ["PIPELINE__DATA__SOURCE"] = source
    from pipeline.cli import main

    rc = main(["--params", ctx["params"]["params_file"], stage, *extra])
    if rc == 1 and stage == "validate":
        raise AirflowFailException("validation failed: see the task log and reports/validation/")
    if rc != 0:
        raise RuntimeError(f"stage {stage} exited with {rc}")


@dag(
    dag_id="agent_retraining",
    description="Self-improvement loop of the PubMedQA research society",
    schedule="@weekly",
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
    },
)
def agent_retraining() -> None:
    @task
    def open_run() -> str:
        _run_stage("run", "open")
        return os.environ["PIPELINE_RUN_ID"]

    @task
    def ingest() -> None:
        _run_stage("ingest")

    @task
    def validate() -> None:
        _run_stage("validate")

    @task(queue="gpu", pool_slots=1)
    def materialize_model() -> None:
        """Base checkpoint -> HF folder for the vLLM workers (model plane; `gpu` queue in production)."""
        _run_stage("materialize-model")

    @task
    def build_index() -> None:
        _run_stage("build-index")

    @task
    def shard_ids() -> list[int]:
        from airflow.sdk import get_current_context

        from pipeline.config import load_params

        os.chdir(PROJECT_ROOT)
        return list(range(load_params(get_current_context()["params"]["params_file"]).rollouts.shards))

    @task(queue="gpu", max_active_tis_per_dagrun=2, map_index_template="shard {{ task.op_kwargs['shard'] }}")
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

    @task(queue="gpu", pool=GPU_POOL, pool_slots=1, execution_timeout=timedelta(hours=6))
    def train_sft() -> None:
        """LoRA SFT of junior_researcher: unsloth on a GPU worker, TRL on CPU; registers a model version."""
        _run_stage("train-sft")

    @task(queue="gpu", pool=GPU_POOL, pool_slots=1, execution_timeout=timedelta(hours=12))
    def train_ppo() -> None:
        """Online RL of senior_researcher: verl via Agent Lightning on a GPU worker, TRL GRPO on CPU; registers a version."""
        _run_stage("train-ppo")

    @task
    def train_bandit() -> None:
        """VW contextual bandit for the supervisor + off-policy evaluation; registers supervisor_policy."""
        _run_stage("train-bandit")

    @task(queue="gpu")
    def evaluate() -> None:
        """Each role's challenger vs its champion on the validation split (MLflow GenAI evaluation)."""
        _run_stage("evaluate")

    @task(queue="gpu")
    def promote() -> None:
        """The gate: promote a candidate that beat its champion (hot-load, routing version, alias)."""
        _run_stage("promote")

    @task.branch
    def promotion_gate() -> str:
        """Branch on the decision: the champion is reported on the test split only when it changed."""
        import json

        result = json.loads((PROJECT_ROOT / "reports/promotion.json").read_text())
        for role, d in result["decisions"].items():
            print(f"{role} v{d['candidate']}: {d['status']} ({d['rule']}): {d['detail']}")
        print(f"champions {result['champions']}; routing version {result['routing_version']} live")
        return "report" if result["promoted"] else "not_promoted"

    @task(queue="gpu")
    def report() -> None:
        """The champion society on the official test split (the only reader of the test split)."""
        _run_stage("report")

    @task
    def not_promoted() -> None:
        """No candidate beat its champion: nothing changed in the registry or the routing."""

    @task(retries=1, trigger_rule="none_failed_min_one_success")
    def version_outputs() -> None:
        """Record the stage outputs in dvc.lock and push them to the DVC remote."""
        import subprocess
        import sys

        from airflow.sdk import get_current_context

        reported = get_current_context()["ti"].xcom_pull(task_ids="promotion_gate") == "report"
        dvc = [sys.executable, "-m", "dvc"]
        stages = [s for s in STAGES if reported or s != "report"]
        subprocess.run([*dvc, "commit", "--force", *stages], cwd=PROJECT_ROOT, check=True)
        subprocess.run([*dvc, "push"], cwd=PROJECT_ROOT, check=True)

    @task(trigger_rule="all_done")
    def close_run() -> None:
        """Mark the MLflow parent run FINISHED or FAILED, whatever happened upstream."""
        from airflow.sdk import get_current_context

        ctx = get_current_context()
        failed = ctx["ti"].get_ti_count(dag_id=ctx["dag"].dag_id, run_ids=[ctx["run_id"]],
                                        states=["failed", "upstream_failed"])
        _run_stage("run", "close", "--status", "FAILED" if failed else "FINISHED")

    run = open_run()
    versioned = version_outputs()
    validated = run >> ingest() >> validate()
    model = run >> materialize_model()
    shards = rollouts.expand(shard=shard_ids())
    [validated >> build_index(), model] >> shards
    trained = shards >> rollout_metrics() >> datasets() >> [train_sft(), train_ppo(), train_bandit()]
    gate = trained >> evaluate() >> promote() >> promotion_gate()
    gate >> [report(), not_promoted()] >> versioned >> close_run()


agent_retraining()
