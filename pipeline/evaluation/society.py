"""Run the society over a list of tasks under one or more routings (the live one or evaluation tables).

The evaluate and report stages use this; the rollouts stage has its own sharded, journaled loop
over the train split. Same rollout code, same seeds per task id, so two models compared on the same
tasks differ only in the model routed in. Several societies (the champion and each candidate) run
in one event loop under one concurrency bound, so the engine always has work in flight. A society
that replays another's record (a candidate replaying the champion) starts each task as soon as that
task's recorded rollout has finished, not after the whole recorded society: the engine keeps both busy.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rich.progress import Progress

from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import Prompts
from pipeline.agents.replay import CallBook
from pipeline.agents.rollout import run_with_retries, supervisor_policy
from pipeline.agents.tools import Toolbox
from pipeline.config import Params
from pipeline.serving import proxy
from pipeline.traces.schema import Trace


# whole Params: running a society reads six sections (agents, judge, reward, rollouts, evaluate, serving) and the
# policy's tracking server; the evaluate and report stages are its only callers.
def run_many(params: Params, tasks: list[dict[str, Any]], societies: list[tuple[dict[str, Any] | None, str | None]], run_id: str,
             prompts: Prompts, score: bool, description: str, books: list[CallBook | None] | None = None,
             sources: list[int | None] | None = None) -> list[list[Trace]]:
    """For each (routing table, evaluation routing name or None for live): one rollout per task
    (rollout id ``<task>-0``, exploration seed ``evaluate.seed``); traces in task order per society.
    ``books[i]``, when given, answers society i's calls that repeat a recorded society's (``evaluate.replay``);
    ``sources[i] = j`` (j < i) adds society j's trace of each task to ``books[i]`` before society i runs that task."""
    url, key = proxy.client_settings(params.serving)
    cfg = params.evaluate
    routed = params.agents.model_copy(update={"supervisor_policy": "routed"})
    policies = [supervisor_policy(routed, params.mlflow, table) for table, _ in societies]
    tools = Toolbox(params.rollouts.index_dir, params.agents.search_top_k)
    replays = books or [None] * len(societies)
    after = sources or [None] * len(societies)
    if any(j is not None and not (0 <= j < i and replays[i] is not None) for i, j in enumerate(after)):
        raise ValueError(f"run_many: a society's source must be an earlier society, and the reader needs a book: {after}")

    async def main(bar: Progress, bar_id: Any) -> list[list[Trace]]:
        sem = asyncio.Semaphore(cfg.concurrency)
        clients = [RoleClient.for_agents(params.agents, url, key, cfg.timeout_s, routing=routing, replay=replays[i],
                                         prompts=prompts)
                   for i, (_, routing) in enumerate(societies)]

        running: dict[tuple[int, int], asyncio.Task[Trace]] = {}

        async def one(i: int, k: int, task: dict[str, Any]) -> Trace:
            ids = {"run_id": run_id, "shard": 0, "task_id": task["id"], "rollout_id": f"{task['id']}-0"}
            version = (societies[i][0] or {}).get("version")
            if (j := after[i]) is not None and (book := replays[i]) is not None:
                book.add(await running[(j, k)])  # the recorded rollout of this task first (waiting holds no slot)
            async with sem:
                trace = await run_with_retries(params.agents, params.judge, params.reward, clients[i], tools, task, ids, cfg.seed,
                                               version, policies[i], cfg.timeout_s, params.rollouts.retries, score=score)
            bar.advance(bar_id)
            return trace

        try:
            for i in range(len(societies)):  # in order: a source's rollouts exist before their readers', and queue first
                for k, t in enumerate(tasks):
                    running[(i, k)] = asyncio.create_task(one(i, k, t))
            flat = await asyncio.gather(*running.values())
        finally:
            for c in clients:
                await c.aclose()
        return [list(flat[i * len(tasks):(i + 1) * len(tasks)]) for i in range(len(societies))]

    with Progress(transient=False) as bar:
        return asyncio.run(main(bar, bar.add_task(description, total=len(tasks) * len(societies))))
