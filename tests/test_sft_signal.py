"""train_sft registers an adapter only on held-out evidence that it learned what made its role's best rollouts better
(slow: real TRL runs in the model plane, on the random-weight test model, against the real MLflow server).

The loss on its own rows falls on any data, so the trainer also compares, on task groups it never trained on, the
best rollout's call with the same call of the task's worst rollout (datasets' ``rejected``), before and after training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import mlflow_login, ROOT, set_param

pytestmark = pytest.mark.slow


def _rows(n: int, worse: str | None = None) -> str:
    """Chat rows shaped as the datasets stage writes them: one rollout a task, each with its worst rollout's same call
    (``worse``) when given."""
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": f"Propose a hypothesis about gene {i}."}]
        rows.append({"prompt": prompt,
                     "completion": [{"role": "assistant", "content": f'{{"hypothesis": "gene {i} raises risk"}}'}],
                     "agent": "junior_1", "task_id": str(i), "rollout_id": f"{i}-0", "run_id": "run", "reward": 0.5,
                     "rejected": None if worse is None else {"prompt": prompt, "output": worse, "reward": 0.1}})
    return "".join(json.dumps(r) + "\n" for r in rows)


def _train(project: Path, serving_models: Path, mlflow_server: str, rows: str, **settings: object):
    """``python -m pipeline train-sft`` on ``rows`` in its own experiment: (report, the stage's run, its versions)."""
    import mlflow

    for key, value in {"base_model": str(serving_models / "tiny"), "merge": False, "max_length": 128, **settings}.items():
        set_param(project, f"sft.{key}", value)
    experiment = f"sft-signal-{project.name}"
    set_param(project, "mlflow.experiment", experiment)
    client = mlflow.MlflowClient(mlflow_server)
    experiment_id = client.create_experiment(experiment)  # what `setup` does for the pipeline's own experiment
    data = project / "data/datasets/sft/junior_researcher/train.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(rows)
    shard = project / "data/rollouts/shard-00000.jsonl"  # the traces behind the rows, as lineage hashes them
    shard.parent.mkdir(parents=True)
    shard.write_text("{}\n")
    (project / "serving/routing").mkdir(parents=True)  # the baselines' deployment (the repository's first routing)
    (project / "serving/routing/v1.yaml").write_text((ROOT / "serving/routing/v1.yaml").read_text())
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "MLFLOW_"))},
           "PIPELINE__MLFLOW__TRACKING_URI": mlflow_server, "PYTHONPATH": str(ROOT), **mlflow_login("writer")}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train-sft"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((project / "reports/train_sft/junior_researcher.json").read_text())
    runs = client.search_runs([experiment_id], "tags.`pipeline.kind` = 'stage'")  # the stage's run (under a pipeline run)
    assert len(runs) == 1, runs
    # the session's server holds other modules' junior versions: only this run's count
    versions = [v for v in client.search_model_versions("name='junior_researcher'") if v.run_id == runs[0].info.run_id]
    return proc.stdout, report, runs[0], versions


def test_sft_that_did_not_fit_its_rows_registers_nothing(project: Path, serving_models: Path, mlflow_server: str) -> None:
    # too small a learning rate to move the loss on its rows by sft.min_fit_drop (1%)
    out, report, run, versions = _train(project, serving_models, mlflow_server, _rows(6), max_steps=2, learning_rate=1e-9)
    assert "no_signal, nothing registered" in out, out[-2000:]
    assert report["steps"] == 2 and report["no_signal"] is True
    assert report["fit_loss_after"] == pytest.approx(report["fit_loss_before"], rel=1e-3)
    assert "did not fall" in report["no_signal_reason"]
    assert run.data.tags.get("no_signal") == "true" and "did not fall" in run.data.tags["no_signal_reason"]
    assert not versions


def test_sft_that_fit_its_rows_but_has_no_held_out_pair_registers_nothing(project: Path, serving_models: Path,
                                                                          mlflow_server: str) -> None:
    """What the loss on its own rows used to register: it falls, but no held-out call has a worse one to compare."""
    out, report, run, versions = _train(project, serving_models, mlflow_server, _rows(6), max_steps=4, learning_rate=5e-3)
    assert report["fit_loss_after"] < report["fit_loss_before"] * 0.99  # it fit its rows ...
    assert report["no_signal"] is True and report["held_out_groups"] == 0  # ... and nothing says it learned more
    assert "no held-out call has a worse counterpart" in report["no_signal_reason"]
    assert run.data.tags.get("no_signal") == "true" and not versions


def test_sft_that_raised_held_out_margin_registers_with_its_evidence(project: Path, serving_models: Path,
                                                                     mlflow_server: str) -> None:
    """The best calls share what the worst lack; 8 held-out tasks (of 40) see it rise on calls it never trained on."""
    out, report, run, versions = _train(project, serving_models, mlflow_server, _rows(40, worse="I cannot tell."),
                                        max_steps=8, batch_size=4, learning_rate=5e-3)
    assert report["no_signal"] is False, report.get("no_signal_reason")
    assert report["held_out_groups"] == 8 and report["held_out_pairs"] == 8
    assert report["held_out_margin"] > report["held_out_margin_before"]
    assert report["held_out_gain_p"] == pytest.approx(1 / 2 ** 8)  # every held-out task gained: the exact test's floor
    assert "held-out margin best - worst call" in out
    assert len(versions) == 1, out[-2000:]
    tags = versions[0].tags
    assert float(tags["signal.held_out_gain_p"]) < 0.05 and tags["signal.held_out_groups"] == "8"
    assert tags["lineage.training_run"] == run.info.run_id
    assert run.data.metrics["held_out_margin"] > run.data.metrics["held_out_margin_before"]
