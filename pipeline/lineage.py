"""Lineage of trained models: DVC content hashes of their inputs and model-version registration.

A registered model version must say exactly which data it learned from. The hash is the one DVC
records in ``dvc.lock`` for that output (``md5`` of each file; a folder's is the md5 of the sorted
JSON list of its files' ``{md5, relpath}`` plus ``.dir``), computed from the files themselves, so
it is right whether the stage runs under ``dvc repro``, Airflow or by hand, and it can be looked
up in the DVC cache/remote (``dvc get --rev``/``dvc.api``) to fetch the same bytes back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline import tracking
from pipeline.digest import file_hash

_IGNORED = ("__pycache__",)


def _file_md5(path: Path) -> str:
    return file_hash(path, "md5")  # DVC's content address, not a security hash


def dvc_md5(path: str | Path) -> str:
    """The hash DVC gives this file or folder as a stage output."""
    path = Path(path)
    if path.is_file():
        return _file_md5(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: nothing to hash")
    entries = [{"md5": _file_md5(f), "relpath": f.relative_to(path).as_posix()}
               for f in path.rglob("*") if f.is_file() and not any(part in _IGNORED for part in f.parts)]
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"  # noqa: S324


def tags(run: Any, dataset_dir: str | Path, rows: list[dict[str, Any]], traces_dir: str | Path | None,
         **extra: Any) -> dict[str, Any]:
    """The lineage every trained version carries: its run, its data (DVC hashes) and the trace runs behind it
    (``traces_dir`` None: data made from the labels alone, no traces behind it)."""
    traces = {} if traces_dir is None else {"lineage.trace_runs": ",".join(sorted({r["run_id"] for r in rows})),
                                            "lineage.traces_md5": dvc_md5(traces_dir)}
    return {"lineage.training_run": run.info.run_id, "lineage.pipeline_run": run.data.tags.get("pipeline.run_id", ""),
            "lineage.dataset_path": str(dataset_dir), "lineage.dataset_md5": dvc_md5(dataset_dir), **traces, **extra}


def register_version(name: str, model_uri: str, run_id: str, tags: dict[str, Any], description: str = "") -> Any:
    """A new version of registered model ``name`` (created on first use) with lineage tags.

    ``model_uri`` is a logged MLflow model (``models:/m-...``: the bandit's pyfunc, a LoRA adapter's pyfunc) or a
    run's plain artifact folder (``runs:/<run>/adapter``: how LoRA versions were registered before they were pyfunc
    models, and what tests register by hand; ``serving.deploy.deploy`` serves both).
    """
    # mlflow: a 1.3 s import, control plane only (the model plane, which has none, imports this module through registry)
    import mlflow  # noqa: PLC0415 - see above
    from mlflow import MlflowClient  # noqa: PLC0415 - see above
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - see above

    client = MlflowClient()
    str_tags = {**tracking.CONTEXT, **{k: str(v) for k, v in tags.items()}}
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description or None)
    if model_uri.startswith("models:/"):
        return mlflow.register_model(model_uri, name, tags=str_tags)
    return client.create_model_version(name, model_uri, run_id=run_id, tags=str_tags)
