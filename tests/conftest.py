"""Shared fixtures: a throwaway project directory and a real MLflow server on loopback."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PUBMEDQA = Path(os.environ.get("PUBMEDQA_DIR", ROOT.parent / "shared" / "data" / "pubmedqa"))
SOURCE = PUBMEDQA / "ori_pqal.json"
TEST_IDS = PUBMEDQA / "test_ground_truth.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SOURCE.exists():
        skip = pytest.mark.skip(reason=f"PubMedQA not found at {SOURCE} (set PUBMEDQA_DIR)")
        for item in items:
            if "pubmedqa" in item.fixturenames:
                item.add_marker(skip)


@pytest.fixture
def pubmedqa() -> dict[str, dict]:
    return json.loads(SOURCE.read_text())


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch project root: params.yaml with absolute data paths; cwd moved there."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"]["source"] = str(SOURCE)
    params["data"]["test_ids"] = str(TEST_IDS)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("PIPELINE__")]:
        monkeypatch.delenv(key)
    return tmp_path


def set_param(root: Path, dotted: str, value: object) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    node = params
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (SQLite + local artifacts) started by the project's code."""
    from pipeline.config import load_params
    from pipeline.services import mlflow_server as server
    from pipeline.services.process import free_port

    home = tmp_path_factory.mktemp("mlflow")
    env = {"PIPELINE__MLFLOW__PORT": str(free_port()), "PIPELINE__MLFLOW__HOME": str(home)}
    params = load_params(ROOT / "params.yaml", environ=env)
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    uri = server.ensure(params)
    try:
        yield uri
    finally:
        server.down(params)
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved


def copy_project(dest: Path) -> Path:
    """Copy the tracked project files (what a fresh clone has) into ``dest`` and make it a git repo."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file() and not rel.startswith(("data/", "models/", "reports/validation/")):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], cwd=dest, check=True)
    return dest
