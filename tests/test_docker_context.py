"""The images' build context (`.dockerignore`, read by docker's own client code) holds code, not secrets."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import ROOT

SECRETS = [".secrets/proxy_key", ".secrets/worker_key", ".services/routing/active.json", ".mlflow/mlflow.db", ".airflow/airflow.cfg",
           ".prod/postgres/pg_hba.conf", "infra/.env", "infra/vllm.env", "data/tasks/train.parquet", "models/base/model.safetensors",
           "dvc-remote/ab/cdef", ".dvc/cache/files/md5/ab/cd", ".dvc/config.local", ".venv/control/bin/python", "mlflow.db",
           "reports/test.json", "pipeline/__pycache__/x.pyc", "serving/tls.key"]


def _context(root: Path) -> set[str]:
    """The files docker would send for `docker build <root>` (docker-py's implementation of the CLI's rules)."""
    from docker.utils.build import exclude_paths

    patterns = [line.strip() for line in (root / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {p for p in exclude_paths(str(root), patterns) if (root / p).is_file()}


def test_context_excludes_secrets_state_data_and_models(tmp_path: Path) -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in [*tracked, *SECRETS]:
        src, dest = ROOT / rel, tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_file() and rel in tracked:
            shutil.copyfile(src, dest)
        else:
            dest.write_text("secret")
    context = _context(tmp_path)
    leaked = [s for s in SECRETS if s in context]
    assert not leaked, f"the build context would ship {leaked}"
    needed = {"params.yaml", "dvc.yaml", "dvc.lock", "pipeline/cli.py", "dags/agent_retraining.py", "requirements/control.lock.txt",
              ".dvc/config", "infra/docker/Dockerfile.control"}
    assert needed <= context, needed - context
