"""The senior RL prompts the ``datasets`` stage wrote: the CPU GRPO trainer's data, the verl trainer's tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Params


def data_dir(params: Params) -> Path:
    return Path(params.datasets.out_dir) / "rl"


def load_prompts(params: Params) -> list[dict[str, Any]]:
    """The senior prompts of the agents ``ppo.agents`` names; raises naming the folder when there are too few."""
    from datasets import load_from_disk  # heavy (pyarrow, fsspec): only the stages that train pay for it

    path = data_dir(params) / "hf"
    if not (path / "dataset_info.json").exists():
        raise FileNotFoundError(f"{path}: no senior RL prompts; run the datasets stage first")
    rows = [r for r in load_from_disk(str(path)).to_list() if r.get("agent") in params.ppo.agents]
    if len(rows) < params.ppo.prompts_per_step:
        raise ValueError(f"{path}: {len(rows)} senior prompts of ppo.agents={params.ppo.agents}, ppo.prompts_per_step needs at least "
                         f"{params.ppo.prompts_per_step}")
    return rows
