"""The embedded default's MLflow tracking server: SQLite backend, local artifact root, loopback.

A server (not a file store) so that the registry, aliases and the UI behave as in production and
parallel Airflow tasks do not race on a local ``mlruns/`` folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.config import Params
from pipeline.services.process import Service, http_ok, port_is_free, start, stop, ServiceError


def _service(params: Params) -> Service:
    return Service("mlflow", Path(params.mlflow.home).resolve())


def local_uri(params: Params) -> str:
    return f"http://{params.mlflow.host}:{params.mlflow.port}"


def tracking_uri(params: Params) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or params.mlflow.tracking_uri or local_uri(params)


def ensure(params: Params) -> str:
    """Return the tracking URI, starting the local server first when none is configured."""
    uri = tracking_uri(params)
    if uri != local_uri(params):
        return uri
    if http_ok(f"{uri}/health"):
        return uri
    if not port_is_free(params.mlflow.host, params.mlflow.port):
        raise ServiceError(
            f"port {params.mlflow.port} is taken by something that is not an MLflow server; "
            "set mlflow.port (or PIPELINE__MLFLOW__PORT)"
        )
    home = Path(params.mlflow.home).resolve()
    (home / "artifacts").mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
        "--artifacts-destination", str(home / "artifacts"),
        "--host", params.mlflow.host, "--port", str(params.mlflow.port),
        "--workers", "1",
    ]
    # Server-side job execution (GenAI scorer jobs) spawns ~8 huey workers of ~400 MB each; the
    # pipeline scores with its own judge, so the embedded default leaves it off.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
    start(_service(params), cmd, f"{uri}/health", env=env, timeout_s=120, meta={"uri": uri})
    return uri


def down(params: Params) -> bool:
    return stop(_service(params))
