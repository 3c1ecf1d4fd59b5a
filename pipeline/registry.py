"""The MLflow model registry as the record of which model each trainable role uses.

One registered model per role in ``promote.roles``. Version 1 is the baseline, registered on first
use and made ``champion``, so a comparison always has something to beat: for an LLM role the model
its routing role is served by now (kind ``base``, its deployment recorded), for the supervisor
policy the LLM supervisor itself (kind ``llm_supervisor``). Trainers register their output as a
new version and point ``challenger`` at it; only promotion moves ``champion``.

A version's ``kind`` says how the society reaches it: ``base`` -> its recorded deployment,
``lora_adapter`` -> ``<worker>/<name>-v<N>-<sha256>`` once hot-loaded into the worker that serves
the role's champion, ``contextual_bandit`` -> ``models:/<name>/<N>`` named in the routing's ``policies``,
``llm_supervisor`` -> ``llm``.

**Served = trained.** Every trained version carries ``sha256``, the digest of its artifact
(``pipeline.digest``) computed from the trainer's own output before it is logged. ``deploy`` verifies
the downloaded artifact against it before anything is hot-loaded or routed and refuses a mismatch
naming both digests; the adapter's served name carries the digest, so a registry reset that reuses
version numbers can never be answered by the old weights cached under the same name.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline import lineage, tracking
from pipeline.config import Params, ServingParams
from pipeline.digest import SHA256_TAG, artifact_sha256, served_name
from pipeline.io import write_json
from pipeline.kinds import Kind
from pipeline.serving import adapter_store, routing
from pipeline.serving import worker as workers

# mlflow is imported in the functions that call it: a 1.3 s import that the serving commands importing this
# module (through promotion) do not need, and the model plane has no mlflow.

CHAMPION, CHALLENGER = "champion", "challenger"
AA = "aa"  # an A/A candidate: the champion's own artifact under another version, gated beside the challenger


class RegistryError(RuntimeError):
    pass


def _client() -> Any:
    from mlflow import MlflowClient  # noqa: PLC0415 - mlflow: 1.3 s import, control plane only

    return MlflowClient()


def get_version(name: str, version: str | int) -> Any:
    return _client().get_model_version(name, str(version))


def by_alias(name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - mlflow: 1.3 s import, control plane only

    try:
        return _client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str | int) -> None:
    _client().set_registered_model_alias(name, alias, str(version))


def set_tags(name: str, version: str | int, tags: dict[str, Any]) -> None:
    """Tag a version (evidence, decisions); values are stored as strings."""
    client = _client()
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))


def delete_alias(name: str, alias: str) -> None:
    _client().delete_registered_model_alias(name, alias)


def _live_target(serving: ServingParams, role: str) -> str:
    table = routing.active(serving) or routing.load_version(serving, routing.versions(serving)[0])
    # a table from before the role had its own model: where its calls went then
    return table["roles"].get(role) or table["roles"][serving.inherits.get(role, role)]


# whole Params: a role's baseline reads five sections (promote, serving, models, agents, mlflow)
def ensure_baselines(params: Params) -> dict[str, Any]:
    """Register the baseline (version 1 on a new registry) of every role without a ``champion`` and make it champion."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - mlflow: 1.3 s import, control plane only

    client = _client()
    champions: dict[str, Any] = {}
    for name, kind in params.promote.roles.items():
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description=f"trainable role {name} of the research society")
        champion = by_alias(name, CHAMPION)
        if champion is not None:
            champions[name] = champion
            continue  # versions registered before any champion existed (older registries) get a baseline below
        if kind == "llm":
            target = _live_target(params.serving, name)
            tags = {"kind": Kind.BASE.value, "deployment": target, "lineage.base_model": params.models.base.source}
            info: dict[str, Any] = {"kind": Kind.BASE.value, "deployment": target, "base_model": params.models.base.source}
        else:
            tags = {"kind": Kind.LLM_SUPERVISOR.value, "policy": "llm"}
            info = {"kind": Kind.LLM_SUPERVISOR.value, "policy": "llm", "epsilon": params.agents.epsilon}
        run = client.create_run(tracking.experiment_id(params.mlflow), run_name=f"baseline-{name}",
                                tags={"pipeline.kind": "baseline"})
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "baseline")
            path.mkdir()
            (path / "baseline.json").write_text(json.dumps(info, indent=1))
            client.log_artifacts(run.info.run_id, str(path), "baseline")
        client.set_terminated(run.info.run_id)
        version = client.create_model_version(name, f"runs:/{run.info.run_id}/baseline", run_id=run.info.run_id,
                                              tags={**tracking.CONTEXT, **tags},
                                              description="baseline: what the society used before any training")
        set_alias(name, CHAMPION, version.version)
        champions[name] = get_version(name, version.version)
    return champions


# whole Params: ensure_baselines reads five sections
def register_aa(params: Params, name: str) -> Any:
    """The champion again, as a new version aliased ``aa``: same artifact, same digest, same kind. The gate must
    refuse it (nothing changed); a cycle that promotes it has a gate that promotes noise."""
    champion = ensure_baselines(params)[name]
    tags = {k: v for k, v in champion.tags.items() if not k.startswith(("promotion.", "eval."))}
    version = lineage.register_version(name, champion.source, champion.run_id, {**tags, "aa_of": str(champion.version)},
                                       f"A/A candidate: v{champion.version}'s artifact under another version")
    set_alias(name, AA, version.version)
    return get_version(name, version.version)


# whole Params: registers after ensure_baselines (five sections)
def register_candidate(params: Params, name: str, model_uri: str, run_id: str, tags: dict[str, Any], description: str = "",
                       artifact: str | Path | None = None) -> Any:
    """A trainer's output: a new version (after the baseline exists), aliased ``challenger``; ``artifact`` (the
    trainer's local output, the same bytes it logged) gives the version its ``sha256`` tag."""
    if artifact is not None:
        tags = {**tags, SHA256_TAG: artifact_sha256(artifact)}
    ensure_baselines(params)
    version = lineage.register_version(name, model_uri, run_id, tags, description)
    set_alias(name, CHALLENGER, version.version)
    return version


# whole Params: register_candidate's five sections, plus rollouts' trace folder for the lineage
def register_adapter(params: Params, run: Any, role: str, adapter_dir: str | Path, dataset_dir: str | Path,
                     rows: list[dict[str, Any]], base_model: str, description: str, *, from_traces: bool = True,
                     **extra_tags: Any) -> Any:
    """A trained LoRA adapter folder: logged to ``run`` as an MLflow pyfunc model (``serving/lora_pyfunc.py``, the
    folder as its artifact ``adapter``) and registered as ``role``'s challenger, tagged ``kind: lora_adapter`` with its
    lineage (run, data, traces, base model) and the folder's sha256 (what ``deploy`` checks before serving it)."""
    tags = lineage.tags(run, dataset_dir, rows, params.rollouts.out_dir if from_traces else None, role=role,
                        kind=Kind.LORA_ADAPTER.value,
                        **{"lineage.base_model": params.models.base.source, "lineage.base_model_path": base_model,
                           "lineage.base_model_md5": lineage.dvc_md5(base_model)}, **extra_tags)
    info = log_adapter_model(adapter_dir, f"{role}-{artifact_sha256(adapter_dir)[:12]}")
    return register_candidate(params, role, info.model_uri, run.info.run_id, tags, description=description, artifact=adapter_dir)


def log_adapter_model(adapter_dir: str | Path, adapter_name: str) -> Any:
    """Log an adapter folder as a self-contained pyfunc in the active run: ``mlflow.pyfunc.load_model`` on it works from
    any directory with mlflow alone (the model hands the adapter to a vLLM worker, see ``serving/lora_pyfunc.py``)."""
    import mlflow  # noqa: PLC0415 - mlflow: 1.3 s import, control plane only
    from mlflow.models import ModelSignature  # noqa: PLC0415 - as above
    from mlflow.types.schema import Array, ColSpec, DataType, Object, Property, Schema  # noqa: PLC0415 - as above

    from pipeline.serving import lora_pyfunc  # noqa: PLC0415 - models-from-code: importing it runs mlflow.models.set_model

    message = Object([Property("role", DataType.string), Property("content", DataType.string)])
    signature = ModelSignature(inputs=Schema([ColSpec(Array(message), "messages")]), outputs=Schema([ColSpec(DataType.string)]))
    return mlflow.pyfunc.log_model(name="adapter", python_model=lora_pyfunc.__file__, artifacts={"adapter": str(adapter_dir)},
                                   model_config={**lora_pyfunc.DEFAULTS, "adapter_name": adapter_name}, signature=signature,
                                   pip_requirements=[f"mlflow=={mlflow.__version__}"])


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
    worker = (worker_of or _live_target(serving, name)).partition("/")[0] if kind.hot_loaded else None
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
    adapter_store.publish(folder, w.adapter_store, adapter)
    workers.load_lora(w, adapter, f"{w.adapter_dir}/{adapter}", wait_s=w.adapter_sync_wait_s)
    return where
