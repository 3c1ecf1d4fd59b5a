"""The embedded default's MLflow tracking server: SQLite backend, local artifact root, loopback, basic auth.

A server (not a file store) so that the registry, aliases and the UI behave as in production and
parallel Airflow tasks do not race on a local ``mlruns/`` folder. It runs MLflow's basic-auth app as the
production stacks do (``mlflow.auth``): every user reads, only ``pipeline-writer`` (the pipeline's stages) writes,
so a registry tag or alias cannot be set without the writer's password (docs/security.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from pipeline.config import MlflowParams
from pipeline.services.mlflow_users import MLFLOW_ADMIN, MLFLOW_USERS, provision_mlflow_users
from pipeline.services.process import Service, ServiceError, claim, http_ok, probe_http, start, stop
from pipeline.serving import keys

CLIENT_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")  # what MLflow's clients authenticate with


def _service(mlflow: MlflowParams) -> Service:
    return Service("mlflow", Path(mlflow.home).resolve())


def local_uri(mlflow: MlflowParams) -> str:
    return f"http://{mlflow.host}:{mlflow.port}"


def tracking_uri(mlflow: MlflowParams) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or mlflow.tracking_uri or local_uri(mlflow)


def _identity(mlflow: MlflowParams) -> dict[str, str]:
    home = Path(mlflow.home).resolve()
    identity = {"backend_store": f"sqlite:///{home / 'mlflow.db'}", "artifacts": str(home / "artifacts")}
    if mlflow.auth:
        identity["auth"] = f"basic-auth sqlite:///{home / 'basic_auth.db'} cache {mlflow.auth_cache_ttl_s}s"
    return identity


def password_file(mlflow: MlflowParams, user: str) -> Path:
    return Path(mlflow.secrets_dir).expanduser() / f"mlflow_{user}_password"


def password(mlflow: MlflowParams, user: str) -> str:
    """The local server's password of ``user`` (admin, writer, reader): generated once, owner-only. One set per OS user
    (``mlflow.secrets_dir``), so every process of that user reaches every local server of its checkouts with one login."""
    return keys.read_or_create(password_file(mlflow, user), prefix="")


def auth_ini(mlflow: MlflowParams) -> str:
    """MLflow's basic-auth config (keys of mlflow/server/auth/config.py), as infra/mlflow-auth.ini with a SQLite user
    store. The cache keeps scrypt (~0.1 s of CPU a check) to once per user a minute instead of once per request."""
    home = Path(mlflow.home).resolve()
    return "\n".join([
        "[mlflow]", "default_permission = READ", f"database_uri = sqlite:///{home / 'basic_auth.db'}",
        f"admin_username = {MLFLOW_ADMIN}", "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
        "grant_default_workspace_access = false", f"auth_cache_ttl_seconds = {mlflow.auth_cache_ttl_s}", ""])


def login(mlflow: MlflowParams, user: str = "writer") -> None:
    """This process (and what it starts) talks to the local server as ``user`` with this checkout's password, unless
    someone logged in as another user on purpose (a person exporting the reader's login)."""
    if mlflow.auth and os.environ.get(CLIENT_ENV[0]) in (None, "", MLFLOW_USERS[user]):
        os.environ[CLIENT_ENV[0]] = MLFLOW_USERS[user]
        os.environ[CLIENT_ENV[1]] = password(mlflow, user)


def _describe(uri: str) -> str:
    try:
        version = httpx.get(f"{uri}/version", timeout=2.0)
        if version.status_code == 200 and version.text.strip()[:1].isdigit():
            return f"an MLflow {version.text.strip()} server"
        if version.status_code == 401 and 'realm="mlflow"' in version.headers.get("www-authenticate", ""):
            return "an MLflow server (basic auth)"  # its version is behind the login
    except httpx.HTTPError:
        pass
    return probe_http(uri)


def connect(mlflow: MlflowParams) -> str:
    """The tracking URI of a server that is already up, this process logged in to it; never starts one. A library call
    (setting up tracking, registering, syncing prompts) connects; entry points start (:func:`ensure`): the CLI before a
    command that tracks, ``services start``, the DAG's tasks through the CLI."""
    uri = tracking_uri(mlflow)
    if uri != local_uri(mlflow):
        return uri
    if not http_ok(f"{uri}/health"):
        raise ServiceError(f"the local MLflow server {uri} is not running: commands that track start it "
                           "(python -m pipeline <command>), or start it with `python -m pipeline services start`")
    login(mlflow)
    return uri


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
             "mlflow.port (PIPELINE__MLFLOW__PORT)", lambda: _describe(uri),
             or_else=", or set MLFLOW_TRACKING_URI to use that server on purpose"):
        login(mlflow)
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
    if mlflow.auth:
        cmd[4:4] = ["--app-name", "basic-auth"]
        config = home / "basic_auth.ini"
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(auth_ini(mlflow))
        # the admin's password is read only when the user store is empty (its first start); secrets travel by env
        env |= {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_AUTH_ADMIN_PASSWORD": password(mlflow, "admin"),
                "MLFLOW_FLASK_SERVER_SECRET_KEY": password(mlflow, "flask_secret")}
    start(_service(mlflow), cmd, f"{uri}/health", env=env, timeout_s=120, meta={"uri": uri}, identity=identity)
    if mlflow.auth:
        try:
            provision_mlflow_users(uri, password(mlflow, "admin"), {role: password(mlflow, role) for role in MLFLOW_USERS})
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 401:
                raise ServiceError(f"mlflow: creating its users failed: {exc}") from exc
            raise ServiceError(f"mlflow: the admin password in {password_file(mlflow, 'admin')} is not "
                               f"the one {home / 'basic_auth.db'} was created with; restore that file, or move the user "
                               "store aside to have it created again") from exc
    login(mlflow)
    return uri


def down(mlflow: MlflowParams) -> bool:
    return stop(_service(mlflow))
