"""Served = trained: a version's sha256 is checked before it is served, names what serves it, and every LLM
span says which weights answered; an evaluation answered by anything else fails."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.digest import artifact_sha256, served_digest, served_name
from pipeline.evaluation.served import check_served
from pipeline.traces.schema import Span, Trace
from tests.conftest import lora_safetensors


def _adapter(folder: Path, weights: bytes = b"\x00\x01", base: str = "models/base") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "base_model_name_or_path": base}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_a_folder_digest_covers_every_byte_but_where_the_engine_keeps_its_base(tmp_path: Path) -> None:
    one = artifact_sha256(_adapter(tmp_path / "a"))
    assert one == artifact_sha256(_adapter(tmp_path / "b", base="/srv/models/base"))  # rewritten at deploy for each worker
    assert one != artifact_sha256(_adapter(tmp_path / "c", weights=b"\x00\x02"))
    (tmp_path / "a" / "extra.bin").write_bytes(b"")
    assert one != artifact_sha256(tmp_path / "a")
    cfg = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    (tmp_path / "b" / "adapter_config.json").write_text(json.dumps({**cfg, "r": 16}))
    assert one != artifact_sha256(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="nothing"):
        artifact_sha256(tmp_path / "nothing")


def test_a_served_name_carries_the_digest_a_span_reads_back() -> None:
    sha = "ab" * 32
    name = served_name("junior_researcher", 3, sha)
    assert name == f"junior_researcher-v3-{sha}"  # the whole digest (#44: a 12-digit prefix is forgeable)
    assert served_digest(f"base/{name}") == sha and served_digest("base") is None and served_digest(None) is None
    assert served_digest("base/junior_researcher-v3-abababababab") == sha[:12]  # a name deployed before: still read


def _trace(deployment: str, role: str = "junior_researcher") -> Trace:
    return Trace(run_id="r", shard=0, task_id="t", rollout_id="x", status="ok", spans=[
        Span(kind="llm", name="junior_a", data={"logical_model": role, "ok": True, "deployment": deployment,
                                                "digest": served_digest(deployment)}),
        Span(kind="llm", name="judge", data={"logical_model": "judge", "ok": True, "deployment": "base", "digest": None})])


def test_an_evaluation_answered_by_other_weights_fails_naming_them() -> None:
    want = f"base/{served_name('junior_researcher', 3, 'cd' * 32)}"
    assert check_served([_trace(want), _trace(want)], "junior_researcher", "3", want) == 2
    stale = f"base/{served_name('junior_researcher', 3, 'ef' * 32)}"  # same version number, other weights (a registry reset)
    with pytest.raises(RuntimeError, match=r"junior_researcher v3 was evaluated as .*cdcdcdcdcdcd.* answered by base/junior_researcher-v3-efefefefefef"):
        check_served([_trace(want), _trace(stale)], "junior_researcher", "3", want)
    with pytest.raises(RuntimeError, match="answered by base "):
        check_served([_trace("base")], "junior_researcher", "3", want)


def test_deploy_refuses_an_artifact_whose_digest_is_not_the_registered_one(tmp_path: Path, mlflow_server: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's bytes are not what the trainer produced (a replaced artifact, a reset registry): nothing is served."""
    import mlflow

    from pipeline import registry
    from pipeline.config import load_params
    from pipeline.serving import deploy
    from tests.conftest import ROOT

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__SERVING__HOME": str(tmp_path / "services")})
    trained, logged = _adapter(tmp_path / "trained"), _adapter(tmp_path / "logged", weights=b"tampered")
    mlflow.set_experiment("digest-it")
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(logged), artifact_path="adapter")
    name = "digest_role"
    from pipeline import lineage

    version = lineage.register_version(name, f"runs:/{run.info.run_id}/adapter", run.info.run_id,
                                       {"kind": "lora_adapter", registry.SHA256_TAG: artifact_sha256(trained)})
    version = registry.get_version(name, version.version)
    loaded: list[str] = []
    monkeypatch.setattr("pipeline.serving.worker.load_lora", lambda *a, **k: loaded.append(a[1]))
    monkeypatch.setattr("pipeline.serving.worker.models", lambda w: [])
    with pytest.raises(registry.RegistryError, match=rf"has sha256 {artifact_sha256(logged)}, but the version was registered with "
                                                     rf"{artifact_sha256(trained)}: not what was trained, refusing to serve it"):
        deploy.deploy(params.serving, name, version, "base")
    assert loaded == [] and not any((tmp_path / "services" / "adapters").glob("digest_role-*"))
    untagged = SimpleNamespace(version="9", tags={"kind": "lora_adapter"}, source=version.source)
    with pytest.raises(registry.RegistryError, match="has no sha256 tag"):
        deploy.deploy(params.serving, name, untagged, "base")


def test_a_lora_version_is_a_pyfunc_model_and_deploy_serves_the_adapter_inside_it(tmp_path: Path, mlflow_server: str,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """register_adapter logs the folder as an MLflow pyfunc (its artifact ``adapter``): the registry holds a model MLflow's
    loaders understand, and deploy still checks and hot-loads exactly the trained bytes."""
    import mlflow

    from pipeline import lineage, registry
    from pipeline.config import load_params
    from pipeline.serving import deploy
    from tests.conftest import ROOT

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__SERVING__HOME": str(tmp_path / "services")})
    payload = lora_safetensors(8, ["q_proj", "v_proj"])  # deploy checks the adapter fits the worker before loading it
    trained = _adapter(tmp_path / "trained", weights=payload)
    mlflow.set_experiment("digest-it")
    with mlflow.start_run() as run, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        info = registry.log_adapter_model(trained, "pyfunc_role-abc")
    # what the stage's log shows a user: MLflow had warned in red of the predict hint and of a missing input example
    assert not [w for w in seen if w.category is UserWarning], [str(w.message)[:120] for w in seen if w.category is UserWarning]
    v = lineage.register_version("pyfunc_role", info.model_uri, run.info.run_id,
                                 {"kind": "lora_adapter", registry.SHA256_TAG: artifact_sha256(trained)})
    version = registry.get_version("pyfunc_role", v.version)
    flavors = mlflow.models.get_model_info(f"models:/pyfunc_role/{v.version}").flavors
    assert flavors["python_function"]["loader_module"].startswith("mlflow.pyfunc")  # models-from-code: no pickle
    loaded: list[tuple[str, str]] = []
    monkeypatch.setattr("pipeline.serving.worker.load_lora", lambda w, name, path, **k: loaded.append((name, path)))
    monkeypatch.setattr("pipeline.serving.worker.models", lambda w: [])
    where = deploy.deploy(params.serving, "pyfunc_role", version, "base")
    assert loaded and loaded[0][0] == where.split("/", 1)[1]
    served = Path(loaded[0][1])
    assert artifact_sha256(served) == artifact_sha256(trained)  # the adapter itself, not the MLflow model folder around it
    assert (served / "adapter_model.safetensors").read_bytes() == payload and not (served / "MLmodel").exists()
