"""The trained supervisor policy: a VW ``--cb_explore_adf`` model behind a small interface.

``BanditPolicy.pmf(question, candidates)`` is all the supervisor needs. Registered in MLflow as a
self-contained pyfunc (``vw_policy.SupervisorPolicyModel``, logged with its code, a signature and an
input example), so any MLflow client can load ``models:/supervisor_policy@champion``.

The pipeline does not: ``load_policy`` runs in rollouts, evaluation and routing checks, before any
gate and in processes that hold keys, so it never executes code from the registry. It downloads the
model's files, checks the ``.vw`` artifact against the version's ``sha256`` tag when there is one,
and reads the ``.vw`` file with VW.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.artifacts
import yaml
from mlflow import MlflowClient

from pipeline import tracking
from pipeline.bandit.vw_policy import BanditPolicy, SupervisorPolicyModel
from pipeline.digest import SHA256_TAG, file_hash
from pipeline.io import inside

if TYPE_CHECKING:
    from pipeline.config import MlflowParams

# SupervisorPolicyModel stays importable from here: versions logged before the policy carried its code import it so
__all__ = ["BanditPolicy", "PolicyDigestError", "SupervisorPolicyModel", "load_policy"]

VW_ARTIFACT = "vw_model"  # the pyfunc artifact key train_bandit logs the .vw file under


class PolicyDigestError(RuntimeError):
    """The downloaded policy file is not the one the registry recorded."""


def _model_version(uri: str) -> Any | None:
    """The registered model version a ``models:/`` URI names (None for ``models:/m-<id>``, a logged
    model that is no registered version). ``name/<n>``, ``name@alias``, ``name/latest``, ``name/<stage>``."""
    client = MlflowClient()
    path = uri.removeprefix("models:/")
    if "@" in path:
        name, alias = path.split("@", 1)
        return client.get_model_version_by_alias(name, alias)
    if "/" not in path:
        return None
    name, suffix = path.split("/", 1)
    if suffix.isdigit():
        return client.get_model_version(name, suffix)
    stages = None if suffix.lower() == "latest" else [suffix]
    latest = client.get_latest_versions(name, stages)
    if not latest:
        raise LookupError(f"{uri}: no version of {name!r}" + (f" in stage {suffix!r}" if stages else ""))
    return max(latest, key=lambda v: int(v.version))


def _vw_file(model_dir: Path, uri: str) -> Path:
    """The ``.vw`` artifact of a downloaded MLflow model folder, from its MLmodel (read as data)."""
    mlmodel = model_dir / "MLmodel"
    if not mlmodel.is_file():
        raise FileNotFoundError(f"{uri}: neither a VW model file nor an MLflow model folder (no MLmodel)")
    meta = yaml.safe_load(mlmodel.read_text()) or {}
    artifact = (((meta.get("flavors") or {}).get("python_function") or {}).get("artifacts") or {}).get(VW_ARTIFACT) or {}
    rel = artifact.get("path") if isinstance(artifact, dict) else None
    if not isinstance(rel, str):
        raise FileNotFoundError(f"{uri}: the MLmodel names no '{VW_ARTIFACT}' artifact (not a supervisor policy)")
    path = inside(model_dir, rel)
    if not path.is_file():
        raise FileNotFoundError(f"{uri}: artifact {rel} is missing from the model")
    return path


def _verify(path: Path, version: Any | None, uri: str) -> str:
    """The file's sha256, refused unless it equals the version's ``sha256`` tag (when it has one)."""
    digest = file_hash(path)
    if version is not None and (expected := (version.tags or {}).get(SHA256_TAG)) is not None:
        want = str(expected).strip().lower().removeprefix("sha256:")
        if want != digest:
            raise PolicyDigestError(f"{uri}: the policy file's sha256 is {digest}, but version {version.version} of "
                                    f"{version.name} is tagged sha256={want}; refusing to load it")
    return digest


def load_policy(uri: str, tracking_cfg: MlflowParams | None = None) -> BanditPolicy:
    """From a ``.vw`` file, an MLflow model folder, or an MLflow URI (``models:/``, ``runs:/``).

    A model is downloaded as files and its ``vw_model`` artifact read directly: the registered version's
    code (``mlflow_model.py``, ``code/``) is never imported. A ``models:/`` URI is resolved to one version
    first (an alias read once), and that version's files are checked against its ``sha256`` tag if it has one.

    With ``tracking_cfg`` (the ``mlflow`` section), an MLflow URI resolves against the project's tracking server:
    callers run before their stage's MLflow run starts, and without it the client looked in the default store
    (./mlflow.db) and a promoted policy "did not exist" (make run's report)."""
    is_mlflow_uri = uri.startswith(("models:/", "runs:/"))
    if tracking_cfg is not None and is_mlflow_uri:
        tracking.setup(tracking_cfg)
    if not is_mlflow_uri:
        path = Path(uri)
        if path.is_file():
            policy = BanditPolicy(path)
        elif path.is_dir():
            policy = BanditPolicy(_vw_file(path, uri), source=uri)
        else:
            raise FileNotFoundError(f"{uri}: no such VW model file or MLflow model folder")
        policy.sha256 = file_hash(policy.model_file)
        return policy
    version = _model_version(uri) if uri.startswith("models:/") else None
    pinned = f"models:/{version.name}/{version.version}" if version is not None else uri
    with tempfile.TemporaryDirectory(prefix="supervisor-policy-") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=pinned, dst_path=tmp))
        vw_file = local if local.is_file() else _vw_file(local, uri)
        digest = _verify(vw_file, version, uri)
        policy = BanditPolicy(vw_file, source=uri)  # VW reads the whole model here; the folder can go
    policy.model_file = f"{pinned}/{vw_file.relative_to(local)}" if vw_file != local else pinned
    policy.sha256 = digest
    policy.version = str(version.version) if version is not None else None
    return policy
