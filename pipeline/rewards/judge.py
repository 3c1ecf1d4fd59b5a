"""LLM-as-judge over the final protocol, and the gold-anchored reward built from its scores.

A rollout's final reward has two parts, weighted by ``reward`` in params.yaml:

- ``judge``: the judge's weighted score of the protocol and decision (six criteria). Groundedness is
  judged against the task's own abstract, which the judge sees and the society does not.
- ``decision``: the PI's decision against the PubMedQA label (GO<->yes, NO-GO<->no, DEFER<->maybe), the one
  verifiable signal of the task: 1 right, 0 wrong or no decision. On a ``maybe`` label DEFER is right and a GO or
  NO-GO earns ``reward.maybe_credit`` (the same for both: no gradient between them).

The judge is an instrument, not a participant: it samples at ``judge.temperature`` (0 by default,
apart from the agents'), and everything the society wrote (protocol, rationale) or the dataset holds
(question, abstract) enters its prompt as JSON-encoded data between tags that the data itself
cannot close, introduced as material to score, never as instructions. A judge that fails or answers
invalid JSON yields ``judge.failure_score`` on every criterion with the reason recorded, never an
exception.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pipeline.agents.llm import LLMError, RoleClient
from pipeline.agents.prompts import Prompts
from pipeline.config import JudgeParams, RewardParams
from pipeline.schemas import ANSWER, Decision, JudgeScores

CRITERIA = ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency")
ALIGN = {d: a for d, a in ANSWER.items() if a != "maybe"}  # the decisions a yes/no label checks


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


def decision_credit(decision: str | None, label: str | None, cfg: RewardParams) -> float:
    """The gold part of the reward: 1 for the decision the label asks for (DEFER on maybe), 0 wrong or undecided, and
    ``maybe_credit`` for a GO or NO-GO on a maybe label (the same for both: no gradient towards either)."""
    if decision not in ANSWER:
        return 0.0
    if label == "maybe":
        return 1.0 if decision == Decision.DEFER else cfg.maybe_credit
    return float(ANSWER[decision] == label)


def final_reward(judge_value: float, decision: str | None, label: str | None,
                 cfg: RewardParams) -> tuple[float, dict[str, float]]:
    """(final reward, its components): the weighted mean of the judge's score and the decision credit."""
    components = {"judge": float(judge_value), "decision": decision_credit(decision, label, cfg)}
    value = (cfg.judge * components["judge"] + cfg.decision * components["decision"]) / (cfg.judge + cfg.decision)
    return value, components


def final_span(value: float, components: dict[str, float], reason: str) -> dict[str, Any]:
    """The rollout's ``final`` reward span: the value and what it is made of (trainers, reports and plots split it)."""
    return {"kind": "reward", "name": "final",
            "data": {"value": value, "kind": "final", "components": components, "reason": reason}}


def as_data(tag: str, value: Any) -> str:
    """Untrusted text as inert data: JSON-encoded (quotes, newlines escaped) with ``<``/``>`` escaped too,
    so nothing inside can close the tag or open another one."""
    text = json.dumps(value, ensure_ascii=True, default=str).replace("<", "\\u003c").replace(">", "\\u003e")
    return f"<{tag}>{text}</{tag}>"


TOP_LOGPROBS = 10
DIGITS = {str(d): d for d in range(10)}


def expected_scores(tokens: list[dict[str, Any]]) -> dict[str, float]:
    """Each criterion's probability-weighted digit (G-Eval): at the token that writes a criterion's score, the
    expectation of the digit under the model's own distribution over 0-9 (renormalised over the digits among the
    top alternatives), in [0, 1]. At temperature 0 the sampled digit is the argmax, which for a small model is the
    same digit on every protocol; the expectation moves with the model's belief and needs no sampling noise."""
    out: dict[str, float] = {}
    text = ""
    for tok in tokens:
        piece = tok.get("token", "")
        if piece.strip() in DIGITS:
            head = text.rstrip()
            crit = next((c for c in CRITERIA if c not in out and head.endswith(f'"{c}":')), None)
            if crit is not None:
                probs = {DIGITS[alt["token"].strip()]: math.exp(alt["logprob"]) for alt in tok.get("top_logprobs") or []
                         if alt.get("token", "").strip() in DIGITS and alt.get("logprob") is not None}
                total = sum(probs.values())
                out[crit] = (sum(d * p for d, p in probs.items()) / total if total > 0 else DIGITS[piece.strip()]) / 9
        text += piece
    return out


def prompt(task: dict[str, Any], state: dict[str, Any], llm_calls: int, prompts: Prompts, abstract_chars: int) -> str:
    """The judge's request for a rollout, rendered from ``prompts`` (the judging society's)."""
    decision = state.get("decision") or {}
    abstract = " ".join(task.get("contexts") or [])[:abstract_chars]
    return prompts.render("judge", question=as_data("question", task["question"]), abstract=as_data("abstract", abstract),
                          protocol=as_data("protocol", state.get("protocol")),
                          decision=as_data("decision", decision.get("decision")),
                          rationale=as_data("rationale", decision.get("rationale", "")), llm_calls=llm_calls)


async def judge(client: RoleClient, cfg: JudgeParams, reward_cfg: RewardParams, task: dict[str, Any], state: dict[str, Any],
                llm_calls: int, spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Score the rollout; appends one reward span per criterion and the ``final`` span with its ``components``."""
    try:
        messages = [{"role": "user", "content": prompt(task, state, llm_calls, client.prompts, cfg.abstract_chars)}]
        scores = await client.structured("judge", cfg.model, messages, JudgeScores, spans, max_tokens=cfg.max_tokens,
                                         frequency_penalty=cfg.frequency_penalty, temperature=cfg.temperature,
                                         top_logprobs=TOP_LOGPROBS, prompt="judge")
        reason = "ok" if scores is not None else "judge returned invalid JSON after retries"
    except LLMError as exc:
        scores, reason = None, f"judge call failed: {exc}"
    tokens: list[dict[str, Any]] = []
    for span in spans:  # the judge's alternatives per token: used here, never stored in the trace
        if span["kind"] == "llm" and span["name"] == "judge" and "logprobs" in span["data"]:
            tokens = span["data"].pop("logprobs")
    values = ({**scores.model_dump(), **{c: getattr(scores, c) / 9 for c in CRITERIA}, **expected_scores(tokens)}
              if scores is not None else {c: cfg.failure_score for c in CRITERIA})
    spans.extend({"kind": "reward", "name": f"judge.{c}", "data": {"value": float(values[c]), "kind": "judge", "reason": reason}}
                 for c in CRITERIA)
    judged = weighted_reward(values, cfg.weights.model_dump()) if scores is not None else cfg.failure_score
    decision = (state.get("decision") or {}).get("decision")
    reward, components = final_reward(judged, decision, task.get("final_decision"), reward_cfg)
    spans.append(final_span(reward, components, reason if scores is None else str(values.get("reason", ""))))
    return {"scores": {c: float(values[c]) for c in CRITERIA}, "reward": reward, "components": components,
            "judge_ok": scores is not None, "reason": reason}
