"""One rollout = the society on one task + the judge, as one ``Trace`` (never raises)."""

from __future__ import annotations

import random
import time
from typing import Any

from pipeline.agents.graph import Society
from pipeline.agents.llm import RoleClient
from pipeline.agents.tools import Toolbox
from pipeline.config import Params
from pipeline.rewards.judge import alignment, judge
from pipeline.traces.schema import Span, Trace


async def run_rollout(params: Params, client: RoleClient, tools: Toolbox, task: dict[str, Any], ids: dict[str, Any],
                      routing_version: int | None = None, policy: Any = None) -> Trace:
    t0 = time.perf_counter()
    rng = random.Random(f"{params.rollouts.seed}:{ids['rollout_id']}")  # exploration reproducible per rollout
    society = Society(client, tools, params.agents, rng, policy)
    state: dict[str, Any] = {"task": task}
    error = None
    try:
        state = await society.compile().ainvoke({"task": task, "review_round": 0},
                                                {"recursion_limit": 10 + 6 * (params.agents.max_review_rounds + 2)})
    except Exception as exc:  # noqa: BLE001 - recorded on the trace, the stage decides what a failure rate means
        error = f"{type(exc).__name__}: {exc}"
    spans = list(state.get("spans", []))
    llm_calls = sum(1 for s in spans if s["kind"] == "llm")
    result: dict[str, Any] = {}
    if error is None and state.get("protocol") and state.get("decision"):
        result = await judge(client, params.judge, task, state, llm_calls, spans)
    else:
        error = error or "; ".join(state.get("errors", [])) or "society produced no protocol/decision"
    decision = (state.get("decision") or {}).get("decision")
    align = alignment(decision, task.get("final_decision"))
    rewards = {**result.get("scores", {}), **({"aligned": float(align["aligned"])} if align["aligned"] is not None else {})}
    return Trace(
        **ids, status="ok" if error is None else "failed", error=error, routing_version=routing_version,
        label=task.get("final_decision"), decision=decision, reward=result.get("reward"), rewards=rewards,
        turns=llm_calls, tokens=sum(s["data"].get("usage", {}).get("total_tokens", 0) for s in spans if s["kind"] == "llm"),
        latency_s=round(time.perf_counter() - t0, 3),
        spans=[Span(kind=s["kind"], name=s["name"], seq=i, data=s["data"]) for i, s in enumerate(spans)],
    )
