"""The MLflow model registry as the record of which model each trainable role uses.

One registered model per role in ``promote.roles``. Version 1 is the baseline, registered on first
use and made ``champion``, so a comparison always has something to beat: for an LLM role the model
its routing role is served by now (kind ``base``, its deployment recorded), for the supervisor
policy the LLM supervisor itself (kind ``llm_supervisor``). Trainers register their output as a
new version and point ``challenger`` at it; only promotion moves ``champion``.

Every trained version carries ``sha256``, the digest of its artifact (``pipeline.digest``) computed from the trainer's
own output before it is logged: ``pipeline/serving/deploy.py`` checks it before it serves the version. This module
records versions and serves nothing (it reads the live routing table only to record where a baseline's calls go).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

from pipeline import lineage, tracking
from pipeline.config import Params, ServingParams
from pipeline.digest import SHA256_TAG, artifact_sha256
from pipeline.kinds import Kind
from pipeline.serving import routing

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


def live_target(serving: ServingParams, role: str) -> str:
    """The deployment the live routing (else its first version) sends ``role``'s calls to: a baseline records it."""
    table = routing.active(serving)
    if table is None:
        if not (numbers := routing.versions(serving)):
            raise FileNotFoundError(f"serving.routing_dir {serving.routing_dir}: no routing version (v<N>.yaml) to take a "
                                    "baseline's deployment from; the repository's serving/routing/v1.yaml is the first")
        table = routing.load_version(serving, numbers[0])
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
            target = live_target(params.serving, name)
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
    with warnings.catch_warnings():
        # an input example MLflow would validate by running the model, which needs a worker serving the base: the
        # signature alone describes the input
        warnings.filterwarnings("ignore", message=".*An input example was not provided", category=UserWarning)
        return mlflow.pyfunc.log_model(name="adapter", python_model=lora_pyfunc.__file__, artifacts={"adapter": str(adapter_dir)},
                                       model_config={**lora_pyfunc.DEFAULTS, "adapter_name": adapter_name}, signature=signature,
                                       pip_requirements=[f"mlflow=={mlflow.__version__}"])
