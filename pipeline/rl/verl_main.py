"""GPU worker entry point of ``train_ppo`` (verl backend): compose the config and call ``run_ppo``.

Started by the control plane with ``AGL_BASE_URL``/``AGL_KEY`` of the gateway it supervises. The
training "dataset" is the train tasks behind the role's RL prompts (one rollout of the whole society
per task and group member), not the prompts themselves: the agent builds its prompts as it goes.
The config is :func:`pipeline.rl.verl_config.compose`'s, the same one ``preflight gpu`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pipeline.config import load_params
from pipeline.data.splits import load_tasks
from pipeline.rl.collect import task_rows
from pipeline.rl.prompts import load_prompts
from pipeline.rl.verl_config import compose, contract


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default=None)
    parser.add_argument("--role", required=True, help="the role of ppo.roles being trained")
    args = parser.parse_args()
    from agentlightning.verl import entrypoint  # noqa: PLC0415 - model plane only (imports verl, torch and ray)

    params = load_params(args.params)
    ppo = params.ppo.at(args.role)
    wanted = {r["task_id"] for r in load_prompts(params.datasets, ppo)}
    tasks = [t for t in load_tasks(params.validate_, "train", setting=params.data.setting) if t["id"] in wanted]
    cols = task_rows(tasks)
    rows = [{"data_id": d, "task_json": j, "prompt": [{"role": "user", "content": json.loads(j)["question"]}],
             "extra_info": {"index": i}} for i, (d, j) in enumerate(zip(cols["data_id"], cols["task_json"], strict=True))]
    checkpoints = os.environ["PUBMEDQA_RL_CHECKPOINTS"]
    worker = params.serving.decoding
    config = compose(ppo, params.mlflow, params.judge, worker, checkpoints, "train_ppo", os.environ["AGL_BASE_URL"],
                     os.environ["AGL_KEY"])
    broken = contract(ppo, params.agents, worker, config)
    if broken:
        raise SystemExit("verl config breaks the project's contract:\n  - " + "\n  - ".join(broken))
    Path(checkpoints).mkdir(parents=True, exist_ok=True)
    entrypoint.run_ppo(config, train_dataset=rows, val_dataset=rows[:1])


if __name__ == "__main__":
    main()
