"""One source for values (#27): params.yaml holds every value; pipeline/config.py holds types, bounds and
descriptions only. A value that came from code would be invisible to DVC (no params dep records it) and could
silently disagree with the file."""

from __future__ import annotations

import ast
from typing import Any

from pydantic import BaseModel

from pipeline import config
from pipeline.config import Params, load_yaml
from tests.conftest import ROOT


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def test_no_field_has_a_default_in_code() -> None:
    tree = ast.parse((ROOT / "pipeline/config.py").read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "_Strict" for b in node.bases):
            for stmt in node.body:
                if not isinstance(stmt, ast.AnnAssign) or stmt.value is None:
                    continue
                v = stmt.value
                is_field = isinstance(v, ast.Call) and getattr(v.func, "id", None) == "Field"
                if not is_field or v.args or any(k.arg in ("default", "default_factory") for k in v.keywords):
                    found.append(f"{node.name}.{ast.unparse(stmt.target)}")
    assert not found, f"values written in pipeline/config.py instead of params.yaml: {found}"


def test_params_yaml_names_every_field() -> None:
    raw = load_yaml((ROOT / "params.yaml").read_text())
    missing: list[str] = []

    def walk(model: type[BaseModel], node: Any, prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = field.alias or name
            if (field.description or "").startswith("derived:"):  # Params._derive_from_the_spec fills it; never written
                continue
            if not isinstance(node, dict) or key not in node:
                missing.append(prefix + key)
            elif _is_model(field.annotation):
                walk(field.annotation, node[key], f"{prefix}{key}.")  # type: ignore[arg-type]

    walk(Params, raw, "")
    assert not missing, f"fields params.yaml does not name (write null where a field is off): {missing}"
    worker_fields = set(config.WorkerParams.model_fields) - {"name", "model", "port"}
    assert set(raw["serving"]["worker_defaults"]) == worker_fields  # each worker: its entry over these
