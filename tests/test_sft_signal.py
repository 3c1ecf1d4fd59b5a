"""train_sft registers nothing when training did not lower the loss on its own rows (slow: a real TRL run in the
model plane, on the random-weight test model, against the real MLflow server).

The learning loop (tests/test_learning_loop.py) checks the other side: SmolLM2's fit loss falls and a version is
registered with its lineage.
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


def _rows(n: int) -> str:
    """Chat rows shaped as the datasets stage writes them (two rollouts, so one is held out for the eval loss)."""
    rows = [{"prompt": [{"role": "user", "content": f"Propose a hypothesis about gene {i}."}],
             "completion": [{"role": "assistant", "content": f'{{"hypothesis": "gene {i} raises risk"}}'}],
             "agent": "junior_1", "task_id": str(i), "rollout_id": f"r{i % 2}-0", "run_id": "run", "reward": 0.5}
            for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_sft_that_did_not_fit_its_rows_registers_nothing(project: Path, serving_models: Path, mlflow_server: str) -> None:
    import mlflow

    set_param(project, "sft.base_model", str(serving_models / "tiny"))
    set_param(project, "sft.max_steps", 2)
    set_param(project, "sft.learning_rate", 1e-9)  # too small to move the loss on its rows by sft.min_fit_drop (1%)
    set_param(project, "sft.merge", False)
    set_param(project, "sft.max_length", 128)
    experiment = f"sft-signal-{project.name}"
    set_param(project, "mlflow.experiment", experiment)
    client = mlflow.MlflowClient(mlflow_server)
    experiment_id = client.create_experiment(experiment)  # what `setup` does for the pipeline's own experiment
    data = project / "data/datasets/sft/junior_researcher/train.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(_rows(6))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "MLFLOW_"))},
           "PIPELINE__MLFLOW__TRACKING_URI": mlflow_server, "PYTHONPATH": str(ROOT), **mlflow_login("writer")}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train-sft"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no_signal, nothing registered" in proc.stdout, proc.stdout[-2000:]
    report = json.loads((project / "reports/train_sft/junior_researcher.json").read_text())
    assert report["steps"] == 2 and report["no_signal"] is True
    assert report["fit_loss_after"] == pytest.approx(report["fit_loss_before"], rel=1e-3)
    assert "did not fall" in report["no_signal_reason"]
    runs = client.search_runs([experiment_id], "tags.`pipeline.kind` = 'stage'")  # the stage's run (under a pipeline run)
    assert len(runs) == 1 and runs[0].data.tags.get("no_signal") == "true"
    assert "did not fall" in runs[0].data.tags["no_signal_reason"]
    # the session's server holds other modules' junior versions: none of them comes from this run
    assert not [v for v in client.search_model_versions("name='junior_researcher'") if v.run_id == runs[0].info.run_id]
