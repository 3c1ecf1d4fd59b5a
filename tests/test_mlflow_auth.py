"""The local MLflow runs MLflow's basic-auth app (#44): a registry tag or alias needs the writer's password."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import mlflow
from mlflow import MlflowClient

from pipeline.config import load_params
from pipeline.services import mlflow_server as local_mlflow
from pipeline.services.mlflow_users import MLFLOW_USERS
from tests.conftest import ROOT


def test_a_forged_registry_tag_needs_the_writers_password(mlflow_server: str, tmp_path: Path) -> None:
    """What rollback once trusted (``promotion.previous_champion``) can be set only by the pipeline's writer user:
    without credentials the server answers 401, as the reader 403, and the tag stays what the writer set."""
    params = load_params(ROOT / "params.yaml")
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == MLFLOW_USERS["writer"]  # what the stages log in as
    mlflow.set_tracking_uri(mlflow_server)
    client = MlflowClient(mlflow_server)
    name = "authz-role"
    client.create_registered_model(name)
    (tmp_path / "policy.txt").write_text("policy")
    with mlflow.start_run() as run:
        mlflow.log_artifact(str(tmp_path / "policy.txt"), "policy")
    version = client.create_model_version(name, f"runs:/{run.info.run_id}/policy", run_id=run.info.run_id).version
    client.set_model_version_tag(name, version, "promotion.previous_champion", "1")
    forged = {"name": name, "version": version, "key": "promotion.previous_champion", "value": "2"}
    url = f"{mlflow_server}/api/2.0/mlflow/model-versions/set-tag"
    anonymous = httpx.post(url, json=forged, timeout=30)
    reader = httpx.post(url, json=forged, timeout=30,
                        auth=(MLFLOW_USERS["reader"], mlflow_server_password(params, "reader")))
    alias = httpx.post(f"{mlflow_server}/api/2.0/mlflow/registered-models/alias", timeout=30,
                       json={"name": name, "alias": "champion", "version": version},
                       auth=(MLFLOW_USERS["reader"], mlflow_server_password(params, "reader")))
    assert (anonymous.status_code, reader.status_code, alias.status_code) == (401, 403, 403)
    seen = httpx.get(f"{mlflow_server}/api/2.0/mlflow/model-versions/get", params={"name": name, "version": version},
                     auth=(MLFLOW_USERS["reader"], mlflow_server_password(params, "reader")), timeout=30)
    assert seen.status_code == 200  # everyone reads
    assert client.get_model_version(name, version).tags["promotion.previous_champion"] == "1"
    assert not client.get_registered_model(name).aliases


def test_the_auth_store_and_passwords_are_owner_only(mlflow_server: str, mlflow_home: Path) -> None:
    params = load_params(ROOT / "params.yaml")
    home = mlflow_home
    for path in (home / "basic_auth.ini", home / "basic_auth.db",
                 *(local_mlflow.password_file(params.mlflow, u) for u in ("admin", "writer", "reader"))):
        assert path.stat().st_mode & 0o077 == 0, path


def mlflow_server_password(params, user: str) -> str:
    return local_mlflow.password(params.mlflow, user)

