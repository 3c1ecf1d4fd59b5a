"""`make run`'s own script, in the parts the learning-loop test cannot reach (it always sets MLFLOW_TRACKING_URI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import load_params
from tests.conftest import ROOT


def test_the_summary_names_the_local_tracking_server_when_no_uri_is_set() -> None:
    """A user's first `make run` has no MLFLOW_TRACKING_URI: the summary's URI comes from params.yaml's mlflow
    section (a signature change once made this line raise after a finished run, so `make run` exited 1)."""
    line = next(s for s in (ROOT / "scripts/run_pipeline.sh").read_text().splitlines() if s.startswith("URI="))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith("PIPELINE__")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH=str(ROOT))
    out = subprocess.run(["bash", "-c", f'set -euo pipefail; {line}; echo "$URI"'], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    mlflow = load_params(ROOT / "params.yaml", environ={}).mlflow
    assert out.stdout.strip() == (mlflow.tracking_uri or f"http://{mlflow.host}:{mlflow.port}")
