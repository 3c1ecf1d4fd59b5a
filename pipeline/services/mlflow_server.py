"""The embedded default's MLflow tracking server: SQLite backend, local artifact root, loopback.

A server (not a file store) so that the registry, aliases and the UI behave as in production and
parallel Airflow tasks do not race on a local ``mlruns/`` folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from pipeline.config import MlflowParams
from pipeline.services.process import Service, claim, probe_http, start, stop


def _service(mlflow: MlflowParams) -> Service:
    return Service("mlflow", Path(mlflow.home).resolve())


def local_uri(mlflow: MlflowParams) -> str:
    return f"http://{mlflow.host}:{mlflow.port}"


def tracking_uri(mlflow: MlflowParams) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or mlflow.tracking_uri or local_uri(mlflow)


def _identity(mlflow: MlflowParams) -> dict[str, str]:
    home = Path(mlflow.home).resolve()
    return {"backend_store": f"sqlite:///{home / 'mlflow.db'}", "artifacts": str(home / "artifacts")}


def _describe(uri: str) -> str:
    try:
        version = httpx.get(f"{uri}/version", timeout=2.0)
        if version.status_code == 200 and version.text.strip()[:1].isdigit():
            return f"an MLflow {version.text.strip()} server"
    except httpx.HTTPError:
        pass
    return probe_http(uri)


def ensure(mlflow: MlflowParams) -> str:
    """Return the tracking URI, starting the local server first when none is configured.

    The local server is reused only if it is this checkout's (same ``mlflow.home`` backend store);
    another project's server on the port is an error, never a silent place to log runs into.
    """
    uri = tracking_uri(mlflow)
    if uri != local_uri(mlflow):
        return uri  # an explicitly configured server: the user chose it
    identity = _identity(mlflow)
    if claim(_service(mlflow), identity, mlflow.host, mlflow.port, f"{uri}/health",
             "mlflow.port (PIPELINE__MLFLOW__PORT), or MLFLOW_TRACKING_URI to use that server on purpose",
             lambda: _describe(uri)):
        return uri
    home = Path(mlflow.home).resolve()
    (home / "artifacts").mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", identity["backend_store"],
        "--artifacts-destination", identity["artifacts"],
        "--host", mlflow.host, "--port", str(mlflow.port),
        "--workers", "1",
    ]
    # Server-side job execution (GenAI scorer jobs) spawns ~8 huey workers of ~400 MB each; the
    # pipeline scores with its own judge, so the embedded default leaves it off.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
    start(_service(mlflow), cmd, f"{uri}/health", env=env, timeout_s=120, meta={"uri": uri}, identity=identity)
    return uri


def down(mlflow: MlflowParams) -> bool:
    return stop(_service(mlflow))
