"""One rollout = the society on one task + the judge, as one ``Trace`` (never raises).

Shared by the rollouts, evaluate and report stages, so every split is run by the same code: with
``score=False`` the judge is left to the caller (evaluation scores through MLflow's evaluation).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from pipeline.agents.graph import Society
from pipeline.agents.llm import ROLLOUT_SEED, RoleClient
from pipeline.agents.replay import ROLLOUT_ID
from pipeline.agents.tools import Toolbox
from pipeline.bandit.policy import load_policy
from pipeline.config import AgentsParams, JudgeParams, MlflowParams, RewardParams
from pipeline.rewards.judge import alignment, final_reward, final_span, judge
from pipeline.traces.schema import Span, Trace


def supervisor_policy(agents: AgentsParams, mlflow: MlflowParams, table: dict[str, Any] | None) -> Any:
    """The policy the supervisor follows (None = the LLM supervisor): from the routing table when
    ``agents.supervisor_policy`` is ``routed`` (what promotion set), else as configured."""
    routed = ((table or {}).get("policies") or {}).get("supervisor_policy", "llm")
    uri = {"llm": "llm", "bandit": agents.bandit_policy}.get(agents.supervisor_policy) or routed
    if uri == "llm":
        return None
    return load_policy(uri, mlflow)


def failed_span(judge_cfg: JudgeParams, reward: RewardParams, decision: str | None, label: str | None,
                error: str | None) -> dict[str, Any]:
    """The ``final`` reward span of a scored rollout that failed: the failure score with its decision credit, what its
    reward would be made of (it trains nothing: status failed); evaluation and the test report read it as any other."""
    value, components = final_reward(judge_cfg.failure_score, decision, label, reward)
    return final_span(value, components, f"rollout failed, not judged: {error}"[:500])


async def run_with_retries(agents: AgentsParams, judge_cfg: JudgeParams, reward: RewardParams, client: RoleClient, tools: Toolbox,
                           task: dict[str, Any], ids: dict[str, Any], seed: int, routing_version: Any, policy: Any,
                           timeout_s: float, retries: int, score: bool = True) -> Trace:
    """A rollout with a timeout per attempt; a timed-out or failed rollout is retried, then returned failed."""
    trace = Trace(**ids, status="failed", error="not run")
    for attempt in range(retries + 1):
        try:
            rollout = run_rollout(agents, judge_cfg, reward, client, tools, task, ids, seed, routing_version, policy, score)
            trace = await asyncio.wait_for(rollout, timeout_s)
        except TimeoutError:  # nothing of the society is left but its task: it decided nothing, and scores as a failure
            error = f"timed out after {timeout_s:.0f}s"
            spans = [Span(seq=0, **failed_span(judge_cfg, reward, None, task.get("final_decision"), error))] if score else []
            trace = Trace(**ids, status="failed", error=error, routing_version=routing_version,
                          label=task.get("final_decision"), spans=spans)
        trace.attempts = attempt + 1
        if trace.status == "ok":
            break
    return trace


async def run_rollout(agents: AgentsParams, judge_cfg: JudgeParams, reward: RewardParams, client: RoleClient, tools: Toolbox,
                      task: dict[str, Any], ids: dict[str, Any], seed: int, routing_version: Any = None, policy: Any = None,
                      score: bool = True) -> Trace:
    """The society on ``task`` (exploration and call seeds from ``seed`` and the rollout id), judged unless ``score`` is off."""
    t0 = time.perf_counter()
    rng = random.Random(f"{seed}:{ids['rollout_id']}")  # exploration reproducible per rollout
    ROLLOUT_ID.set(ids["rollout_id"])  # a client replaying recorded calls answers only from this rollout's record
    if client.replay is not None:  # ...from its start, on every attempt
        client.replay.rewind(ids["rollout_id"])
    if agents.seeded_calls:  # ...and every call's sampling seed (this task's context only)
        ROLLOUT_SEED.set(f"{seed}:{ids['rollout_id']}")
    society = Society(client, tools, agents, rng, policy)
    state: dict[str, Any] = {"task": task}
    error = None
    try:
        state = await society.compile().ainvoke({"task": task, "review_round": 0},
                                                {"recursion_limit": 10 + 6 * (agents.max_review_rounds + 2)})
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    spans = list(state.get("spans", []))
    llm_calls = sum(1 for s in spans if s["kind"] == "llm")
    result: dict[str, Any] = {}
    if error is None and not (state.get("protocol") and state.get("decision")):
        error = "; ".join(state.get("errors", [])) or "society produced no protocol/decision"
    decision = (state.get("decision") or {}).get("decision")
    if error is None and score:
        result = await judge(client, judge_cfg, reward, task, state, llm_calls, spans)
    elif score:
        spans.append(failed_span(judge_cfg, reward, decision, task.get("final_decision"), error))
    align = alignment(decision, task.get("final_decision"))
    rewards = {**result.get("scores", {}), **{f"reward_{k}": v for k, v in result.get("components", {}).items()},
               **({"aligned": float(align["aligned"])} if align["aligned"] is not None else {})}
    return Trace(
        **ids, status="ok" if error is None else "failed", error=error, routing_version=routing_version,
        label=task.get("final_decision"), decision=decision, reward=result.get("reward"), rewards=rewards,
        protocol=state.get("protocol"), rationale=(state.get("decision") or {}).get("rationale"), turns=llm_calls,
        tokens=sum(s["data"].get("usage", {}).get("total_tokens", 0) for s in spans if s["kind"] == "llm"),
        latency_s=round(time.perf_counter() - t0, 3),
        spans=[Span(kind=s["kind"], name=s["name"], seq=i, data=s["data"]) for i, s in enumerate(spans)],
    )
