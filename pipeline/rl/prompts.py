"""The senior RL prompts the ``datasets`` stage wrote: the CPU GRPO trainer's data, the verl trainer's tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import load_from_disk

from pipeline.config import DatasetsParams, PpoSettings


def data_dir(datasets: DatasetsParams) -> Path:
    return Path(datasets.out_dir) / "rl"


def load_prompts(datasets: DatasetsParams, ppo: PpoSettings) -> list[dict[str, Any]]:
    """The senior prompts of the agents ``ppo.agents`` names; raises naming the folder when there are too few."""
    path = data_dir(datasets) / "hf"
    if not (path / "dataset_info.json").exists():
        raise FileNotFoundError(f"{path}: no senior RL prompts; run the datasets stage first")
    rows = [r for r in load_from_disk(str(path)).to_list() if r.get("agent") in ppo.agents]
    if len(rows) < ppo.prompts_per_step:
        raise ValueError(f"{path}: {len(rows)} senior prompts of ppo.agents={ppo.agents}, ppo.prompts_per_step needs at least "
                         f"{ppo.prompts_per_step}")
    return rows
