"""Run the society over a list of tasks under one or more routings (the live one or evaluation tables).

The evaluate and report stages use this; the rollouts stage has its own sharded, journaled loop
over the train split. Same rollout code, same seeds per task id, so two models compared on the same
tasks differ only in the model routed in. Several societies (the champion and each candidate) run
in one event loop under one concurrency bound, so the engine always has work in flight. Societies whose
books share their draws (a candidate replaying the champion, ``CallBook.sharing``) run a task side by
side when the bound lets them: a request one of them has in flight answers the other's same request, and
the engine decodes the rest of both at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import Prompts
from pipeline.agents.replay import CallBook
from pipeline.agents.rollout import run_with_retries, supervisor_policy
from pipeline.agents.tools import Toolbox
from pipeline.config import Params
from pipeline.progress import Bar, bars
from pipeline.serving import proxy
from pipeline.traces.schema import Trace


# whole Params: running a society reads six sections (agents, judge, reward, rollouts, evaluate, serving) and the
# policy's tracking server; the evaluate and report stages are its only callers.
def run_many(params: Params, tasks: list[dict[str, Any]], societies: list[tuple[dict[str, Any] | None, str | None]], run_id: str,
             prompts: Prompts, score: bool, description: str, books: list[CallBook | None] | None = None) -> list[list[Trace]]:
    """For each (routing table, evaluation routing name or None for live): one rollout per task
    (rollout id ``<task>-0``, exploration seed ``evaluate.seed``); traces in task order per society.
    ``books[i]``, when given, answers society i's calls that repeat a recorded or running society's (``evaluate.replay``)."""
    url, key = proxy.client_settings(params.serving)
    cfg = params.evaluate
    routed = params.agents.model_copy(update={"supervisor_policy": "routed"})
    policies = [supervisor_policy(routed, params.mlflow, table) for table, _ in societies]
    tools = Toolbox(params.rollouts.index_dir, params.agents.search_top_k)
    replays = books or [None] * len(societies)

    async def main(shown: list[Bar]) -> list[list[Trace]]:
        sem = asyncio.Semaphore(cfg.concurrency)
        clients = [RoleClient.for_agents(params.agents, url, key, cfg.timeout_s, routing=routing, replay=replays[i],
                                         prompts=prompts)
                   for i, (_, routing) in enumerate(societies)]

        async def one(i: int, task: dict[str, Any]) -> Trace:
            ids = {"run_id": run_id, "shard": 0, "task_id": task["id"], "rollout_id": f"{task['id']}-0"}
            version = (societies[i][0] or {}).get("version")
            async with sem:
                trace = await run_with_retries(params.agents, params.judge, params.reward, clients[i], tools, task, ids, cfg.seed,
                                               version, policies[i], cfg.timeout_s, params.rollouts.retries, score=score)
            shown[i].advance()
            return trace

        try:  # society by society: the champion's rollouts queue first; beyond the bound, a candidate's task starts when
            # a slot frees, mostly after the champion's rollout of it has drawn what they share
            flat = await asyncio.gather(*(one(i, t) for i in range(len(societies)) for t in tasks))
        finally:
            for c in clients:
                await c.aclose()
        return [list(flat[i * len(tasks):(i + 1) * len(tasks)]) for i in range(len(societies))]

    with bars() as new:  # a bar a society: the champion's queue first, a replayed one after it
        names = [routing or "live" for _, routing in societies]
        return asyncio.run(main([new(f"{description}: {name}" if len(societies) > 1 else description, len(tasks))
                                 for name in names]))
