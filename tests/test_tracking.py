"""The MLflow client setup every stage goes through (`pipeline.tracking.setup`), against the pinned MLflow."""

from __future__ import annotations

import argparse
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


def test_setting_up_tracking_starts_no_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#53: services are started by entry points (the CLI before a command that tracks), never by a library call:
    pointing the client at a local server that is not up is a one-line error naming it, and nothing is started."""
    from pipeline.services.process import ServiceError, free_port, port_is_free

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    port = free_port()
    cfg = load_params().mlflow.model_copy(update={"tracking_uri": None, "port": port, "home": str(tmp_path / "mlflow")})
    with pytest.raises(ServiceError, match=rf"the local MLflow server http://127\.0\.0\.1:{port} is not running"):
        tracking.setup(cfg)
    assert port_is_free("127.0.0.1", port) and not (tmp_path / "mlflow").exists()
    from pipeline import cli

    assert cli.tracks(type("M", (), {})(), argparse.Namespace()) and not cli.tracks(
        type("M", (), {})(), argparse.Namespace(no_mlflow=True))
    from pipeline.serving import worker

    assert not cli.tracks(worker, argparse.Namespace())  # a vLLM worker process starts no tracking server


@pytest.mark.parametrize("server", ["hung", "dead"])
def test_a_stage_whose_tracking_server_is_gone_ends_in_one_line_within_its_deadline(server: str) -> None:
    """#56: MLflow killed under a stage held it for 400 s (MLflow's 120 s timeout, 7 retries). With the pipeline's
    deadline and retries (mlflow.request_timeout_s, request_retries) a server that accepts but never answers ("hung")
    or one that is gone ("dead") ends the stage within timeout x (retries + 1) + backoff, in one line naming it."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from pipeline.services.process import free_port
    from tests.conftest import ROOT

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel completes connections; nothing ever answers
        port = listener.getsockname()[1] if server == "hung" else free_port()
        uri = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "MLFLOW_"))}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "open"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**env, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri,
                                                "PIPELINE__MLFLOW__REQUEST_TIMEOUT_S": "2",
                                                "PIPELINE__MLFLOW__REQUEST_RETRIES": "2"})
        took = time.monotonic() - started
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: the MLflow tracking server {uri} did not answer"), lines
    assert took < 2 * 3 + (1 + 2) + 15, took  # 3 requests of 2 s, backoff 1 s + 2 s, the process's start
