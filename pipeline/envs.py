"""Where the two planes' interpreters live.

The control plane (Airflow, DVC, MLflow, agents) and the CPU model plane (vLLM, torch, TRL) pin
libraries that cannot share a venv, so stages that need torch re-run themselves under the model
plane's interpreter. ``scripts/setup_envs.sh`` creates both and links them under ``.venv/``;
production images set ``PIPELINE_MODEL_PYTHON`` instead (the GPU image: its own interpreter).

The plane is said, never guessed: a stage's ``main`` is the control plane (MLflow run, registry)
wherever it runs, and it re-runs itself with ``--in-model-plane`` for the part that needs torch.
Guessing "model plane" from ``import torch`` broke the GPU image, whose one interpreter has both:
training ran there but nothing was logged or registered.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def model_python() -> str:
    explicit = os.environ.get("PIPELINE_MODEL_PYTHON")
    if explicit:
        return explicit
    linked = REPO_ROOT / ".venv" / "model" / "bin" / "python"
    if linked.exists():
        return str(linked)
    raise RuntimeError(
        "model-plane interpreter not found: run `make setup` (creates .venv/model) "
        "or set PIPELINE_MODEL_PYTHON to a Python with vllm/torch/transformers"
    )


def pythonpath() -> str:
    """A child's PYTHONPATH: this checkout first (so ``python -m pipeline`` and ``pipeline`` imports resolve from any
    working directory), then whatever the caller already had, each entry once: a service's identity includes it, and a
    caller whose PYTHONPATH already named the checkout (a stage started by another) must not restart the proxy."""
    entries = [str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def run_in_model_plane(argv: Sequence[str]) -> int:
    """Re-run ``python -m pipeline <argv>`` under the model-plane interpreter (streams output)."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.call([model_python(), "-m", "pipeline", *argv], env=env)
