"""Every notebook in notebooks/ executes top to bottom against real stage outputs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from pipeline.config import load_params
from pipeline.stages import ingest, validate
from tests.conftest import ROOT

# compare_checkpoints reads evaluated versions from MLflow: executed in test_promotion_integration.py
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if p.name != "compare_checkpoints.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ingest.run(load_params())
    validate.run(load_params())
    monkeypatch.setenv("PIPELINE_ROOT", str(project))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(project)}}).execute()
    if path.name.startswith("01_"):
        assert (project / "reports" / "label_shares.png").exists()
