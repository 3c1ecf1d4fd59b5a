"""Make a registered version reachable by the society: where it is routed, and an adapter hot-loaded first.

The registry (``pipeline/registry.py``) records versions; this module serves them. A version's ``kind`` says how the
society reaches it: ``base`` -> its recorded deployment, ``lora_adapter`` -> ``<worker>/<name>-v<N>-<sha256>`` once
hot-loaded into the worker that serves the role's champion, ``contextual_bandit`` -> ``models:/<name>/<N>`` named in the
routing's ``policies``, ``llm_supervisor`` -> ``llm``.

**Served = trained.** :func:`deploy` verifies the downloaded artifact against the ``sha256`` the version was registered
with before anything is hot-loaded or routed and refuses a mismatch naming both digests; the adapter's served name
carries the digest, so a registry reset that reuses version numbers can never be answered by the old weights cached
under the same name.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import ServingParams
from pipeline.digest import SHA256_TAG, artifact_sha256, served_name
from pipeline.io import write_json
from pipeline.kinds import Kind
from pipeline.registry import RegistryError, live_target
from pipeline.serving import adapter_store
from pipeline.serving import worker as workers


def adapter_folder(downloaded: Path) -> Path:
    """The adapter inside a downloaded LoRA version: the pyfunc's ``adapter`` artifact (MLmodel says where), or the
    folder itself (versions logged as plain files before LoRA versions were pyfunc models)."""
    mlmodel = downloaded / "MLmodel"
    if not mlmodel.exists():
        return downloaded
    artifacts = (yaml.safe_load(mlmodel.read_text()).get("flavors", {}).get("python_function", {}).get("artifacts") or {})
    rel = (artifacts.get("adapter") or {}).get("path")
    if not rel or not (downloaded / rel / "adapter_config.json").exists():
        raise RegistryError(f"{downloaded}: an MLflow model without an 'adapter' artifact holding adapter_config.json")
    return downloaded / rel


def adapter_name(name: str, version: Any) -> str:
    """The name a worker serves a LoRA version under: role, version and digest (a reused version number never collides)."""
    return served_name(name, version.version, expected_sha256(name, version))


def expected_sha256(name: str, version: Any) -> str:
    digest = version.tags.get(SHA256_TAG)
    if not digest:
        raise RegistryError(f"{name} v{version.version} has no {SHA256_TAG} tag (registered before versions carried their "
                            "digest): retrain or re-register it; an unverifiable artifact is never served")
    return str(digest)


def target(serving: ServingParams, name: str, version: Any, worker_of: str | None = None) -> str:
    """Where the society reaches ``version``: a routing deployment (LLM roles) or a policy URI."""
    try:
        kind = Kind(version.tags.get("kind"))
    except ValueError:
        raise RegistryError(f"{name} v{version.version}: unknown kind {version.tags.get('kind')!r}; cannot route it") from None
    worker = (worker_of or live_target(serving, name)).partition("/")[0] if kind.hot_loaded else None
    try:
        return kind.target(name, str(version.version), version.tags.get("deployment"), worker,
                           adapter_name(name, version) if kind.hot_loaded else None)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None


def routes_policy(version: Any) -> bool:
    """Whether the society reaches ``version`` through the routing's ``policies`` rather than a deployment."""
    try:
        return Kind(version.tags.get("kind")).policy
    except ValueError:
        raise RegistryError(f"v{version.version}: unknown kind {version.tags.get('kind')!r}; cannot route it") from None


def _name_base_model(config: Path, model: str) -> None:
    """Name the base model the way the serving engine does. Training records its own path for it
    (``models/base``, a download folder); vLLM's filesystem resolver, which reloads adapters into a
    restarted replica, only takes an adapter whose base model is the engine's ``--model``."""
    cfg = json.loads(config.read_text())
    if cfg.get("base_model_name_or_path") != model:
        write_json(config, {**cfg, "base_model_name_or_path": model})


def deploy(serving: ServingParams, name: str, version: Any, worker_of: str | None = None) -> str:
    """Make ``version`` reachable (hot-load an adapter into its worker) and return its target."""
    import mlflow  # noqa: PLC0415 - mlflow: 1.3 s import, control plane only

    where = target(serving, name, version, worker_of)
    if version.tags.get("kind") != Kind.LORA_ADAPTER:
        return where
    worker_name, _, adapter = where.partition("/")
    w = next((w for w in serving.workers if w.name == worker_name), None)
    if w is None:
        raise RegistryError(f"{name} v{version.version}: no worker {worker_name!r} in serving.workers")
    want = expected_sha256(name, version)
    folder = workers.adapter_cache(serving) / adapter  # kept even once loaded: a restarted local worker reloads from it
    if not (folder / "adapter_config.json").exists() or artifact_sha256(folder) != want:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{adapter}-"))
        try:
            local = adapter_folder(Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(tmp))))
            got = artifact_sha256(local)
            if got != want:
                raise RegistryError(f"{name} v{version.version}: the registry's artifact {version.source} has sha256 {got}, "
                                    f"but the version was registered with {want}: not what was trained, refusing to serve it")
            shutil.rmtree(folder, ignore_errors=True)
            local.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _name_base_model(folder / "adapter_config.json", workers.model_id(w))
    for f in folder.rglob("*"):  # read-only once deployed: the worker's guard checks these bytes at every load
        if f.is_file():
            f.chmod(0o444)
    workers.check_adapter(w, folder)
    if adapter in workers.models(w):
        return where
    if w.adapter_store is None:
        workers.load_lora(w, adapter, str(folder))
        return where
    # a worker on another host: publish to its S3 store, its sidecar copies the adapter next to it
    adapter_store.publish(folder, w.adapter_store, adapter, w.adapter_store_s3)
    workers.load_lora(w, adapter, f"{w.adapter_dir}/{adapter}", wait_s=w.adapter_sync_wait_s)
    return where
