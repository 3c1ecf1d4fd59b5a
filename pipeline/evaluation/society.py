"""Run the society over a list of tasks under one routing (the live one or an evaluation table).

The evaluate and report stages use this; the rollouts stage has its own sharded, journaled loop
over the train split. Same rollout code, same seeds per task id, so two models compared on the same
tasks differ only in the model routed in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.config import Params
from pipeline.traces.schema import Trace


def run(params: Params, tasks: list[dict[str, Any]], table: dict[str, Any], routing: str | None, run_id: str,
        score: bool, description: str) -> list[Trace]:
    """One rollout per task (rollout id ``<task>-0``, exploration seed ``evaluate.seed``), with progress."""
    from rich.progress import Progress

    from pipeline.agents.llm import RoleClient
    from pipeline.agents.rollout import run_with_retries, supervisor_policy
    from pipeline.agents.tools import Toolbox
    from pipeline.serving import proxy

    url, key = proxy.client_settings(params)
    cfg = params.evaluate
    policy = supervisor_policy(params.model_copy(update={"agents": params.agents.model_copy(update={"supervisor_policy": "routed"})}), table)
    tools = Toolbox(params.rollouts.index_dir, params.agents.search_top_k)

    async def main(bar: Progress, task_id: Any) -> list[Trace]:
        client = RoleClient(url, key, params.agents.max_tokens, params.agents.temperature, params.agents.json_retries, cfg.timeout_s,
                            routing=routing)
        sem = asyncio.Semaphore(cfg.concurrency)

        async def one(task: dict[str, Any]) -> Trace:
            ids = {"run_id": run_id, "shard": 0, "task_id": task["id"], "rollout_id": f"{task['id']}-0"}
            async with sem:
                trace = await run_with_retries(params, client, tools, task, ids, table["version"], policy, cfg.timeout_s,
                                               params.rollouts.retries, score=score, seed=cfg.seed)
            bar.advance(task_id)
            return trace

        try:
            return list(await asyncio.gather(*[one(t) for t in tasks]))
        finally:
            await client.aclose()

    with Progress(transient=False) as bar:
        return asyncio.run(main(bar, bar.add_task(description, total=len(tasks))))
