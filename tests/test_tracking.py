"""The MLflow client setup every stage goes through (`pipeline.tracking.setup`), against the pinned MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import environment_variables as mlflow_env
from mlflow.tracking import fluent
from mlflow.tracking._tracking_service import utils as tracking_utils

from pipeline import tracking
from pipeline.config import load_params


@pytest.mark.parametrize("presigned", [False, True])
def test_setup_sets_the_presigned_switches_mlflow_reads(presigned: bool, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the switches MLflow's proxied-artifact client consults before asking the server (mlflow_artifacts_repo:
    # `.is_set()` wins over the server's advertised capability): if a release renames them, the setting does nothing
    switches = (mlflow_env.MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD, mlflow_env.MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD)
    assert {s.name for s in switches} == set(tracking.PRESIGNED_ENV)
    for name in (*tracking.PRESIGNED_ENV, "MLFLOW_EXPERIMENT_ID"):  # set_experiment exports the id; restored after
        monkeypatch.delenv(name, raising=False)
    # the client's process-wide tracking URI and active experiment, which setup sets: restored after the test
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    monkeypatch.setattr(fluent, "_active_experiment_id", fluent._active_experiment_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")  # a store, no server to start
    params = load_params()
    tracking.setup(params.mlflow.model_copy(update={"presigned_urls": presigned}))
    assert all(s.is_set() and s.get() is presigned for s in switches)
