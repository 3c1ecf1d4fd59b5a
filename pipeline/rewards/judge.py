"""LLM-as-judge over the final protocol, and the weighted reward built from its scores.

Groundedness is judged against the task's own abstract, which the judge sees and the society does
not (it only sees what its tools return). A judge that fails or answers invalid JSON yields
``judge.failure_score`` on every criterion with the reason recorded, never an exception.
"""

from __future__ import annotations

from typing import Any

from pipeline.agents.llm import LLMError, RoleClient
from pipeline.config import JudgeParams
from pipeline.schemas import JudgeScores

CRITERIA = ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency")
ALIGN = {"GO": "yes", "NO-GO": "no"}


def weighted_reward(scores: dict[str, float], weights: dict[str, float]) -> float:
    total = sum(weights.values())
    return sum(weights[c] * float(scores.get(c, 0.0)) for c in CRITERIA) / total


def alignment(decision: str | None, label: str | None) -> dict[str, Any]:
    """GO<->yes, NO-GO<->no; a 'maybe' label is reported separately, not counted as right or wrong."""
    if label == "maybe":
        return {"aligned": None, "maybe": True}
    if decision not in ALIGN or label not in ("yes", "no"):
        return {"aligned": None, "maybe": False}
    return {"aligned": ALIGN[decision] == label, "maybe": False}


async def judge(client: RoleClient, cfg: JudgeParams, task: dict[str, Any], state: dict[str, Any], llm_calls: int,
                spans: list[dict[str, Any]]) -> dict[str, Any]:
    abstract = " ".join(task.get("contexts") or [])[:1800]
    decision = state.get("decision") or {}
    prompt = (f"You are a strict scientific judge. Question: {task['question']}\nPublished abstract: {abstract}\n"
              f"Proposed protocol: {state.get('protocol')}\nPI decision: {decision.get('decision')} - {decision.get('rationale', '')}\n"
              f"The team used {llm_calls} model calls. Score each criterion in [0, 1]: novelty, feasibility, impact, clarity, "
              "groundedness (agreement with the abstract), efficiency (fewer calls is better). JSON only.")
    try:
        scores = await client.structured("judge", "judge", [{"role": "user", "content": prompt}], JudgeScores, spans, max_tokens=cfg.max_tokens,
                                         frequency_penalty=cfg.frequency_penalty)
        reason = "ok" if scores is not None else "judge returned invalid JSON after retries"
    except LLMError as exc:
        scores, reason = None, f"judge call failed: {exc}"
    weights = cfg.weights.model_dump()
    values = scores.model_dump() if scores is not None else {c: cfg.failure_score for c in CRITERIA}
    spans.extend({"kind": "reward", "name": f"judge.{c}", "data": {"value": float(values[c]), "kind": "judge", "reason": reason}}
                 for c in CRITERIA)
    reward = weighted_reward(values, weights) if scores is not None else cfg.failure_score
    spans.append({"kind": "reward", "name": "final", "data": {"value": reward, "kind": "final",
                                                              "reason": reason if scores is None else values.get("reason", "")}})
    return {"scores": {c: float(values[c]) for c in CRITERIA}, "reward": reward, "judge_ok": scores is not None, "reason": reason}
