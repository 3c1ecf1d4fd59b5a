"""End to end on the embedded default: real MLflow server, real DVC, real Airflow (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from pipeline import runs
from pipeline.config import load_params
from tests.conftest import ROOT, copy_project
from tests.test_learning_loop import CYCLE

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """What a fresh clone looks like, with shared/ beside it as in CI."""
    (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    return copy_project(tmp_path / "proj")


def _env(mlflow_uri: str, run_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "AIRFLOW"))}
    from pipeline.envs import model_python

    # the copied project has no .venv/: point it at this checkout's model plane, as `make` does
    env.update(PATH=f"{BIN}:{env['PATH']}", MLFLOW_TRACKING_URI=mlflow_uri, PIPELINE_RUN_ID=run_id, PYTHONPATH="",
               PIPELINE_MODEL_PYTHON=model_python(), **SMALL_LOOP, **extra)
    return env


# the whole loop, smaller still than tests/test_learning_loop.py (this checks orchestration, that one
# checks learning): two SFT steps; serving on free ports. The one tool step stays: without it a rollout
# whose juniors all need a repair gives no SFT row and `datasets` fails the run (seen with 0 tool steps)
SMALL_LOOP = {**CYCLE, "PIPELINE__SFT__MAX_STEPS": "2"}


def _serving_env() -> dict[str, str]:
    from pipeline.services.process import free_port

    # SmolLM2: the random-weight test model's rollouts never produce training data, and the DAG trains
    return {"PIPELINE__SERVING__WORKERS": f"[{{name: base, model: models/base, port: {free_port()}, dtype: float32}}]",
            "PIPELINE__SERVING__PROXY__PORT": str(free_port())}


def _runs(mlflow_uri: str, run_id: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("society-retraining")
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`pipeline.run_id` = '{run_id}'")


def _corrupt(dest: Path) -> Path:
    """A copy of PQA-L with one bad label, under the project's data/ (a local root data.allow permits)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads((ROOT.parent / "shared/data/pubmedqa/ori_pqal.json").read_text())
    test_ids = set(json.loads((ROOT.parent / "shared/data/pubmedqa/test_ground_truth.json").read_text()))
    victim = next(k for k in data if k not in test_ids)
    data[victim]["final_decision"] = "perhaps"
    dest.write_text(json.dumps(data))
    return dest


def test_corrupt_input_stops_dvc_pipeline(clone: Path, mlflow_server: str) -> None:
    bad = _corrupt(clone / "data/incoming/bad.json")
    env = _env(mlflow_server, f"it-{uuid.uuid4().hex[:6]}", PIPELINE__DATA__SOURCE=str(bad))
    proc = subprocess.run(["dvc", "repro", "validate"], cwd=clone, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "'perhaps'" in proc.stdout + proc.stderr
    assert not (clone / "data/validated").exists()


SERVING = _serving_env()


def _airflow(clone: Path, home: Path, mlflow_uri: str, run_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    from pipeline.services.airflow_server import airflow_env

    env = _env(mlflow_uri, run_id, **SERVING, **{k: v for k, v in airflow_env(home).items() if k != "PYTHONPATH"})
    env.update(AIRFLOW__CORE__DAGS_FOLDER=str(clone / "dags"), PIPELINE_ROOT=str(clone), PYTHONPATH=str(clone))
    return subprocess.run([str(BIN / "airflow"), *args], cwd=clone, env=env, capture_output=True, text=True, timeout=1800)


@pytest.mark.e2e  # `make test-all`: the learning-loop test already runs the whole loop once in `make test`
def test_airflow_dag_runs_stages_and_versions_outputs(clone: Path, mlflow_server: str, tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    assert _airflow(clone, home, mlflow_server, "", "db", "migrate").returncode == 0
    try:
        proc = _airflow(clone, home, mlflow_server, "", "dags", "test", "agent_retraining")
    finally:
        subprocess.run([sys.executable, "-m", "pipeline", "services", "down", "serving"], cwd=clone,
                       env=_env(mlflow_server, "", **SERVING), capture_output=True)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert (clone / "data/validated/train.parquet").exists()
    lock = (clone / "dvc.lock").read_text()
    assert "data/validated" in lock and "data/rollouts" in lock
    assert "data/datasets/sft" in lock and "models/sft/junior_researcher" in lock and "models/bandit" in lock
    assert "models/prompt/principal_investigator" in lock  # the prompt kind's artifact is versioned as every other kind's
    assert len(list((clone / "data/rollouts").glob("shard-*.jsonl"))) == 2  # one file per mapped shard task
    assert (clone / "models/sft/junior_researcher/adapter/adapter_config.json").exists()
    promotion = json.loads((clone / "reports/promotion.json").read_text())
    assert "champions: {" in proc.stdout + proc.stderr  # the gate's decision is in the task log
    # `report` runs (and is versioned) only on the promoted branch; "not promoted" skips it cleanly
    stages = [] if promotion["promoted"] else [s for s in yaml.safe_load((clone / "dvc.yaml").read_text())["stages"] if s != "report"]
    _assert_lock_is_the_runs(clone, stages, _env(mlflow_server, ""))

    validated = (clone / "data/validated/train.parquet").read_bytes()
    outside = _corrupt(tmp_path / "bad.json")  # a file outside data.allow.local_roots: refused before it is read
    proc = _airflow(clone, home, mlflow_server, "", "dags", "test", "agent_retraining", "-c", json.dumps({"data_source": str(outside)}))
    assert proc.returncode != 0 and "outside data.allow.local_roots" in proc.stdout + proc.stderr
    bad = _corrupt(clone / "data/incoming/bad.json")
    proc = _airflow(clone, home, mlflow_server, "", "dags", "test", "agent_retraining", "-c", json.dumps({"data_source": str(bad)}))
    log = proc.stdout + proc.stderr
    assert "'perhaps'" in log  # refused by ingest's row checks, before data/tasks/ is replaced
    assert proc.returncode != 0 and "state=failed" in log  # close_run is a teardown: the failed stage fails the DAG run
    # nothing downstream ran: outputs and their DVC record are those of the good run
    assert (clone / "dvc.lock").read_text() == lock
    assert (clone / "data/validated/train.parquet").read_bytes() == validated

    _browse_ui(home, ARTIFACTS)


def _assert_lock_is_the_runs(clone: Path, stages: list[str], env: dict[str, str]) -> None:
    """dvc.lock records the values the DAG run used (pipeline/runs.py): its effective params (params.yaml plus the
    run's overrides, here SMALL_LOOP's) and the routing it found, not the files as they are after it. So with those
    two standing in, every stage it ran is up to date; against the files as they are, `dvc status` names only
    params and the routing (which the run's promotion moved), never an output."""
    found = sorted((clone / runs.RUNS_DIR).glob("*/params.yaml"))
    assert len(found) == 1 and runs.routing_snapshot(found[0]).exists(), found
    live = load_params(clone / "params.yaml").serving.live_file
    with contextlib.chdir(clone), runs.run_inputs(found[0].relative_to(clone), live):  # as the DAG's commit-lock did
        status = subprocess.run(["dvc", "status", *stages], cwd=clone, env=env, capture_output=True, text=True)
        assert "up to date" in status.stdout, status.stdout
    status = subprocess.run(["dvc", "status", "--json", *stages], cwd=clone, env=env, capture_output=True, text=True)
    changed = json.loads(status.stdout or "{}")
    assert changed, "the run's overrides (SMALL_LOOP) differ from params.yaml: dvc status must say so"
    for stage, entries in changed.items():
        for entry in entries:
            assert isinstance(entry, dict) and set(entry) == {"changed deps"}, (stage, entry)
            assert set(entry["changed deps"]) <= {"params.yaml", live}, (stage, entry)


ARTIFACTS = ROOT / "test-artifacts"  # screenshots of the UI test (gitignored)


def _browse_ui(home: Path, artifacts: Path) -> None:
    """Headless Chromium (Debian's, `scripts/setup_browser.sh`) through Selenium: log into the embedded
    Airflow UI, open the DAG's grid with the finished runs and its trigger form, check the mapped
    rollouts and the Params render, and keep screenshots."""
    from selenium.webdriver.common.by import By

    from pipeline.services import airflow_server
    from pipeline.services.process import free_port
    from tests.conftest import airflow_browser

    port = free_port()
    old_home = os.environ.get("AIRFLOW_HOME")
    os.environ["AIRFLOW_HOME"] = str(home)
    info = airflow_server.up(port=port)
    artifacts.mkdir(exist_ok=True)
    try:
        with airflow_browser(info["url"], info["user"], info["password"]) as driver:
            driver.get(f"{info['url']}/dags/agent_retraining")
            driver.find_element(By.CSS_SELECTOR, "button[aria-label='Expand all task groups']").click()
            driver.find_element(By.XPATH, "//*[starts-with(normalize-space(), 'rollouts [')]")  # the mapped shard task
            grid = driver.find_element(By.TAG_NAME, "body").text
            for name in ("prepare", "collect", "train", "decide", "record", "train_ppo", "promotion_gate", "pubmedqa_source_data"):
                assert name in grid, name
            driver.save_screenshot(str(artifacts / "airflow-grid.png"))
            driver.find_element(By.XPATH, "//button[normalize-space()='Trigger']").click()
            driver.find_element(By.XPATH, "//*[normalize-space()='Run Parameters']")
            form = driver.find_element(By.TAG_NAME, "body").text
            for param in ("params_file", "data_source", "shards", "samples_per_task", "trainers", "eval_limit", "margin", "dry_run"):
                assert param in form, param
            driver.save_screenshot(str(artifacts / "airflow-trigger.png"))
    finally:
        airflow_server.down()
        if old_home is None:
            os.environ.pop("AIRFLOW_HOME", None)
        else:
            os.environ["AIRFLOW_HOME"] = old_home
    assert (artifacts / "airflow-grid.png").stat().st_size > 10_000
