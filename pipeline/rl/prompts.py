"""The RL prompts the ``datasets`` stage wrote: the CPU GRPO trainer's data, the verl trainer's tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import load_from_disk

from pipeline.config import DatasetsParams, PpoRole


def data_dir(datasets: DatasetsParams) -> Path:
    return Path(datasets.out_dir) / "rl"


def load_prompts(datasets: DatasetsParams, ppo: PpoRole) -> list[dict[str, Any]]:
    """The prompts of the agents ``ppo.roles.<role>.agents`` names; raises naming the folder when there are too few."""
    path = data_dir(datasets) / "hf"
    if not (path / "dataset_info.json").exists():
        raise FileNotFoundError(f"{path}: no RL prompts; run the datasets stage first")
    rows = [r for r in load_from_disk(str(path)).to_list() if r.get("agent") in ppo.agents]
    if len(rows) < ppo.prompts_per_step:
        raise ValueError(f"{path}: {len(rows)} prompts of ppo.roles.{ppo.role}.agents={ppo.agents}, ppo.prompts_per_step "
                         f"needs at least {ppo.prompts_per_step}")
    return rows
