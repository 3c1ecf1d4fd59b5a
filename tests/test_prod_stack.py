"""The production executor on this host (`make prod-stack`): Postgres + Redis from Debian's packages,
moto's S3 server, MLflow on Postgres with S3 artifacts, Airflow with the CeleryExecutor and one
worker per queue. Both tests are `make test-all`'s (e2e): every service answers and stores where it
should, and the whole DAG runs on it end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import mlflow
import pytest

from infra.local import prod_stack
from pipeline import tracking
from pipeline.config import Params, load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from tests.conftest import ROOT, copy_project
from tests.test_pipeline_integration import SMALL_LOOP, _serving_env

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if subprocess.run(["bash", str(ROOT / "scripts/setup_prod_stack.sh")], check=False).returncode != 0:
        pytest.fail("scripts/setup_prod_stack.sh could not install postgresql/redis-server")
    root = tmp_path_factory.mktemp("prod")
    (root / "shared").symlink_to(ROOT.parent / "shared")
    clone = copy_project(root / "proj")
    # Postgres runs as the `postgres` user when the tests run as root: its home must be traversable, which
    # pytest's 0700 temp folders are not
    home = Path(tempfile.mkdtemp(prefix="prod-stack-"))
    home.chmod(0o755)
    ports = {"PIPELINE__PROD_STACK__HOME": str(home), **{f"PIPELINE__PROD_STACK__{k.upper()}_PORT": str(free_port())
                                                       for k in ("postgres", "redis", "s3", "mlflow", "airflow")}}
    # what the Celery workers (and so every task) inherit: the loop sized as the Airflow e2e test sizes it
    work_env = {**SMALL_LOOP, **_serving_env(), **ports, "PIPELINE_MODEL_PYTHON": model_python(),
                "PATH": f"{BIN}:{os.environ['PATH']}"}
    saved = {k: os.environ.get(k) for k in work_env}
    os.environ.update(work_env)
    params = load_params(clone / "params.yaml")
    try:
        info = prod_stack.up(params.prod_stack, clone)
        prod_stack.use_s3_remote(params.prod_stack, clone)
        # MLflow asks for a user: the tests' clients log and read as the writer, as the Airflow tasks do
        client_env = prod_stack.mlflow_client_env(params.prod_stack)
        saved.update({k: os.environ.get(k) for k in client_env})
        os.environ.update(client_env)
        yield {"params": params, "clone": clone, "info": info, "home": home}
    finally:
        prod_stack.down(params.prod_stack)
        subprocess.run([sys.executable, "-m", "pipeline", "services", "down", "serving"], cwd=clone, capture_output=True,
                       check=False)
        shutil.rmtree(home, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _s3_keys(params: Params, bucket: str) -> list[str]:
    env = prod_stack.s3_env(params.prod_stack)
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.mark.e2e  # ~90 s of CI for what the DAG run below checks as well: `make test-all`
def test_every_service_answers_and_stores_where_compose_would(stack: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    params, clone, cfg = stack["params"], stack["clone"], stack["params"].prod_stack
    health = httpx.get(f"{stack['info']['url']}/api/v2/monitor/health").json()
    assert {health[c]["status"] for c in ("metadatabase", "scheduler", "dag_processor", "triggerer")} == {"healthy"}
    assert all(prod_stack.status(cfg).values())
    assert all(prod_stack.worker_ready(cfg, q) for q in cfg.workers)  # one Celery worker per queue answers through Redis
    # MLflow: runs in Postgres, artifacts in the S3 bucket
    client = mlflow.MlflowClient(prod_stack.mlflow_uri(cfg))
    exp = client.create_experiment("prod-stack-it")
    run = client.create_run(exp)
    client.log_text(run.info.run_id, "stored in S3", "note.txt")
    assert any(k.endswith(f"{run.info.run_id}/artifacts/note.txt") for k in _s3_keys(params, "mlflow"))
    # ... and back as a stage downloads an adapter: this server offers presigned downloads (MLflow >= 3.17), which the
    # stack's S3 refuses; the pipeline's client setup (mlflow.presigned_urls: false) keeps them on the server
    writer = prod_stack.mlflow_client_env(cfg)
    info = httpx.get(f"{prod_stack.mlflow_uri(cfg)}/api/3.0/mlflow/server-info", timeout=30,
                     auth=(writer["MLFLOW_TRACKING_USERNAME"], writer["MLFLOW_TRACKING_PASSWORD"])).json()
    assert info.get("multipart_downloads_enabled") is True
    for name in ("MLFLOW_TRACKING_URI", *tracking.PRESIGNED_ENV):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", prod_stack.mlflow_uri(cfg))
    tracking.setup(params.mlflow)
    with tempfile.TemporaryDirectory() as tmp:
        got = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="note.txt", dst_path=tmp)
        assert Path(got).read_text() == "stored in S3"
    # DVC: the clone's default remote is the stack's S3 bucket
    (clone / "probe.txt").write_text("dvc on s3\n")
    env = {**os.environ, **prod_stack.s3_env(cfg)}
    for cmd in (["add", "probe.txt"], ["push", "probe.txt"]):
        proc = subprocess.run([sys.executable, "-m", "dvc", *cmd], cwd=clone, env=env, capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr
    assert _s3_keys(params, "dvc")
    subprocess.run([sys.executable, "-m", "dvc", "remove", "probe.txt.dvc"], cwd=clone, env=env, capture_output=True, check=True)
    (clone / "probe.txt").unlink()


@pytest.mark.e2e
def test_dag_runs_end_to_end_on_celery_with_gpu_tasks_on_the_gpu_worker(stack: dict) -> None:
    params, clone = stack["params"], stack["clone"]
    health = httpx.get(f"{stack['info']['url']}/api/v2/monitor/health").json()
    assert {health[c]["status"] for c in ("metadatabase", "scheduler", "dag_processor", "triggerer")} == {"healthy"}
    result = prod_stack.dag_run(params.prod_stack, {"tasks": 1, "samples_per_task": 2, "shards": 2, "eval_limit": 1},
                                timeout_s=3000)
    tis = result["task_instances"]
    assert result["state"] == "success", [(t["task_id"], t["state"]) for t in tis]
    assert prod_stack.misplaced(tis) == []
    ran = {(t["task_id"], t["map_index"]): t for t in tis if t["state"] == "success"}
    gpu = {t["task_id"] for t in ran.values() if t["queue"] == "gpu"}
    assert {"rollouts", "train_sft", "evaluate", "promote"} <= gpu  # the DAG's GPU-bound tasks ...
    assert all(t["hostname"].startswith("gpu-worker.") for t in ran.values() if t["queue"] == "gpu")  # ... ran on the gpu worker
    assert any(t["hostname"].startswith("default-worker.") for t in ran.values() if t["queue"] == "default")
    assert {("rollouts", 0), ("rollouts", 1)} <= set(ran)  # the mapped shards

    # MLflow on Postgres with artifacts in S3; DVC pushed to the S3 remote
    client = mlflow.MlflowClient(prod_stack.mlflow_uri(params.prod_stack))
    exp = client.get_experiment_by_name(params.mlflow.experiment)
    parents = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("pipeline.kind") == "parent"]
    assert parents and parents[0].info.status == "FINISHED"
    assert client.search_model_versions("name='junior_researcher'")
    assert _s3_keys(params, "mlflow")
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--cloud"], cwd=clone, capture_output=True, text=True,
                            env={**os.environ, **prod_stack.s3_env(params.prod_stack)}, check=False)
    assert status.returncode == 0 and "are in sync" in status.stdout, status.stdout + status.stderr  # everything pushed to S3
    promotion = json.loads((clone / "reports/promotion.json").read_text())
    assert promotion["routing_version"] >= 1
