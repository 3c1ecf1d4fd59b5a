"""DAG integrity: imports cleanly, no cycles, every task owned and retried, cheap to parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DAG_FILE = ROOT / "dags" / "agent_retraining.py"
HEAVY = ["mlflow", "great_expectations", "pandas", "pyarrow", "langgraph", "torch", "vllm", "litellm", "pipeline.stages", "dvc"]


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory: pytest.TempPathFactory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow")))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    from airflow.models.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags"))  # include_examples= raises on 3.3 (upstream #70283)


def test_no_import_errors(dagbag) -> None:
    assert dagbag.import_errors == {}
    assert "agent_retraining" in dagbag.dags


def test_no_cycles(dagbag) -> None:
    from airflow.utils.dag_cycle_tester import check_cycle

    for dag in dagbag.dags.values():
        check_cycle(dag)


def test_every_task_has_owner_and_retries(dagbag) -> None:
    dag = dagbag.dags["agent_retraining"]
    for t in dag.tasks:
        assert t.owner and t.owner != "airflow", f"{t.task_id} has no owner"
        assert t.retries >= 1, f"{t.task_id} has no retries"


def test_stages_in_order(dagbag) -> None:
    dag = dagbag.dags["agent_retraining"]
    assert dag.get_task("validate").upstream_task_ids == {"ingest"}
    assert dag.get_task("build_index").upstream_task_ids == {"validate"}
    assert dag.get_task("materialize_model").upstream_task_ids == {"preflight_gpu"}  # nothing holds a GPU before the profile is checked
    assert dag.get_task("preflight_gpu").upstream_task_ids == {"open_run"}
    assert dag.get_task("rollouts").upstream_task_ids == {"build_index", "materialize_model", "shard_ids"}
    assert dag.get_task("datasets").upstream_task_ids == {"rollout_metrics"}
    assert dag.get_task("train_sft").upstream_task_ids == {"datasets"}
    assert dag.get_task("train_ppo").upstream_task_ids == {"datasets"}
    assert dag.get_task("train_bandit").upstream_task_ids == {"datasets"}
    assert dag.get_task("train_pi").upstream_task_ids == {"validate", "materialize_model"}  # gold labels: no rollouts
    assert dag.get_task("train_prompt").upstream_task_ids == {"validate", "materialize_model"}  # asks the served champion
    assert dag.get_task("evaluate").upstream_task_ids == {"train_sft", "train_pi", "train_ppo", "train_bandit", "train_prompt"}
    assert dag.get_task("promotion_gate").upstream_task_ids == {"promote"}
    assert dag.get_task("promotion_gate").downstream_task_ids == {"report", "not_promoted"}
    assert dag.get_task("version_outputs").upstream_task_ids == {"report", "not_promoted"}
    assert dag.get_task("version_outputs").trigger_rule == "none_failed_min_one_success"  # a skipped branch is not a failure
    close = dag.get_task("close_run")  # a teardown: always runs, and a failed stage still fails the DAG run
    assert close.is_teardown and close.trigger_rule == "all_done_setup_success" and dag.get_task("open_run").is_setup


def test_schedule_and_params(dagbag) -> None:
    dag = dagbag.dags["agent_retraining"]
    assert dag.max_active_runs == 1
    assert {"params_file", "data_source"} <= set(dag.params.keys())


def test_parse_is_cheap_and_imports_nothing_heavy() -> None:
    """Parse the file the way the dag-processor does; heavy libraries must not load at top level."""
    code = f"""
import json, sys, time
import airflow.sdk  # the processor has this loaded already
t0 = time.perf_counter()
import runpy
runpy.run_path({str(DAG_FILE)!r})
elapsed = time.perf_counter() - t0
heavy = [m for m in {HEAVY!r} if any(k == m or k.startswith(m + '.') for k in sys.modules)]
print(json.dumps({{"elapsed": elapsed, "heavy": heavy}}))
"""
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["elapsed"] < 1.0, f"DAG file took {result['elapsed']:.2f}s to parse"


def test_gpu_stages_on_gpu_queue_and_pool(dagbag) -> None:
    dag = dagbag.dags["agent_retraining"]
    for trainer in ("train_sft", "train_pi", "train_ppo"):
        t = dag.get_task(trainer)
        assert t.queue == "gpu" and t.pool == "gpu", trainer
    assert dag.get_task("rollouts").queue == "gpu"
    # under the KubernetesExecutor every gpu-queue task gets the GPU pod template of infra/k8s/
    template = ROOT / "infra/k8s/pod-template-gpu.yaml"
    for t in dag.tasks:
        if t.queue == "gpu":
            assert Path(t.executor_config["pod_template_file"]).name == template.name, t.task_id
    pod = yaml.safe_load(template.read_text())
    assert pod["kind"] == "Pod" and pod["spec"]["containers"][0]["name"] == "base"  # the container Airflow runs the task in
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_dvc_commit_covers_every_dvc_stage() -> None:
    """version_outputs records every stage of dvc.yaml, so an Airflow run versions what `dvc repro` would."""
    from dags.agent_retraining import STAGES

    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list", "--name-only"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()  # DVC's own expansion of the foreach stages
    assert set(STAGES) == set(listed) and "train_sft@junior_researcher" in listed


def test_groups_params_schedule_and_callbacks(dagbag) -> None:
    from airflow.timetables.assets import AssetOrTimeSchedule

    dag = dagbag.dags["agent_retraining"]
    groups = dag.task_group.children
    assert {"prepare", "collect", "train", "decide", "record"} <= set(groups)
    assert all(groups[g].doc_md for g in ("prepare", "collect", "train", "decide", "record")) and dag.doc_md
    assert {t.task_id for t in groups["train"].children.values()} == {"train_sft", "train_pi", "train_ppo", "train_bandit",
                                                                     "train_prompt"}
    assert {"shards", "tasks", "samples_per_task", "trainers", "eval_limit", "margin", "dry_run"} <= set(dag.params.keys())
    assert dag.params["trainers"] == ["sft", "pi", "ppo", "bandit", "prompt"]
    assert isinstance(dag.timetable, AssetOrTimeSchedule) and "pubmedqa_source_data" in str(dag.timetable.asset_condition)
    assert dag.get_task("evaluate").trigger_rule == "none_failed_min_one_success"  # a trainer left out is skipped, not failed
    for t in dag.tasks:
        assert t.on_failure_callback, f"{t.task_id} has no failure callback"
        assert t.execution_timeout is not None, f"{t.task_id} has no execution timeout"


def test_run_params_become_stage_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from dags.agent_retraining import RUN_PARAMS, _apply_run_params

    monkeypatch.chdir(ROOT)
    saved = dict(os.environ)
    try:  # _apply_run_params writes os.environ (as in a task process): restore it whole, other tests load params too
        for env in RUN_PARAMS.values():
            os.environ.pop(env, None)
        _apply_run_params({"run_id": "manual__2026-01-01T00:00:00+00:00", "params": {"params_file": "params.yaml",
            "shards": 3, "tasks": None, "samples_per_task": 4, "eval_limit": 8, "margin": 0.02, "dry_run": True}})
        from pipeline.config import load_params

        p = load_params(ROOT / "params.yaml")
        assert (p.rollouts.shards, p.rollouts.samples_per_task, p.evaluate.limit, p.promote.margin, p.promote.dry_run) == (3, 4, 8, 0.02, True)
        assert p.rollouts.limit == load_params(ROOT / "params.yaml", environ={}).rollouts.limit  # None = params.yaml
        assert os.environ["PIPELINE_RUN_ID"] == "manual__2026-01-01T00_00_00_00_00"
        from pipeline.config import ParamsError

        with pytest.raises(ParamsError, match="only params.yaml"):  # a run cannot load a params file from anywhere
            _apply_run_params({"run_id": "manual__x", "params": {"params_file": "/tmp/evil.yaml"}})
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_failure_callback_records_the_task_on_the_mlflow_parent_run(mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import mlflow

    from dags.agent_retraining import _record_failure

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.chdir(ROOT)
    ti = SimpleNamespace(task_id="train_ppo", try_number=3)
    saved = dict(os.environ)
    try:  # the callback sets PIPELINE_RUN_ID like a task process does: keep it out of the other tests
        _record_failure({"ti": ti, "run_id": "scheduled__cb-test", "params": {"params_file": "params.yaml"},
                         "exception": RuntimeError("stage train-ppo exited with 1")})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    client = mlflow.MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("society-retraining")
    parent = client.search_runs([exp.experiment_id], "tags.`pipeline.run_id` = 'scheduled__cb-test' and tags.`pipeline.kind` = 'parent'")[0]
    assert parent.data.tags["failed_tasks"] == "train_ppo"
    assert parent.data.tags["failed.train_ppo"] == "try 3: RuntimeError('stage train-ppo exited with 1')"


def test_a_gate_that_asks_a_person_puts_an_approval_task_between_promote_and_the_report(tmp_path: Path) -> None:
    """#55: `approval: required` in a role's gate values gives its candidate an approval task (Airflow's HITLOperator:
    Approve or Reject, Reject on timeout) after the gate and before `promotion_gate`; roles that do not ask have none."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["roles"]["principal_investigator"]["gate"] = {"approval": "required"}
    raw["promote"]["approval_timeout_h"] = 6
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    code = f"""
import json, runpy
ns = runpy.run_path({str(DAG_FILE)!r})
dag = ns["agent_retraining"]()
out = {{t.task_id: {{"up": sorted(t.upstream_task_ids), "down": sorted(t.downstream_task_ids), "rule": getattr(t.trigger_rule, "value", t.trigger_rule),
                     "type": type(t).__name__, "options": getattr(t, "options", None), "defaults": getattr(t, "defaults", None),
                     "timeout_h": t.response_timeout.total_seconds() / 3600 if getattr(t, "response_timeout", None) else None}}
        for t in dag.tasks}}
print(json.dumps(out))
"""
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PIPELINE_ROOT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tasks = json.loads(proc.stdout.strip().splitlines()[-1])
    pi = "principal_investigator"
    assert tasks[f"awaits_{pi}"]["up"] == ["promote"] and tasks[f"awaits_{pi}"]["down"] == [f"approve_{pi}"]
    ask = tasks[f"approve_{pi}"]
    assert ask["type"] == "HITLOperator" and ask["options"] == ["Approve", "Reject"] and ask["defaults"] == ["Reject"]
    assert ask["timeout_h"] == 6 and ask["down"] == [f"answer_{pi}"]
    assert tasks[f"answer_{pi}"]["down"] == ["promotion_gate"]
    # the prompt candidate of the same role asks too (its gate is the role's); the other roles' candidates do not
    assert f"approve_{pi}_prompt" in tasks and not [t for t in tasks if t.startswith("approve_") and pi not in t]
    assert tasks["promotion_gate"]["rule"] == "none_failed"
    assert set(tasks["promotion_gate"]["up"]) == {f"answer_{pi}", f"answer_{pi}_prompt"}


def test_no_approval_task_where_no_gate_asks_for_one(dagbag) -> None:
    dag = dagbag.dags["agent_retraining"]
    assert not [t.task_id for t in dag.tasks if t.task_id.startswith(("awaits_", "approve_", "answer_"))]
