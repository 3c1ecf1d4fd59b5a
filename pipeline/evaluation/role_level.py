"""A role whose output the label checks, scored on that output alone: the PI's decision on every question.

A whole-society comparison costs minutes a task and its paired differences spread wide (sd 0.29 of the final reward):
25 tasks detect only a 0.15 gain. The PI's decision is the one output a PubMedQA label checks, so a PI candidate is
scored on its own decision for every question of a split, paired with the champion PI on the same inputs.

**What the PI answers**: exactly what the society's PI node asks and serves (``pipeline.agents.decision.ask``, the one
decision path): the decision read at ``agents.decision.prefix`` from the PI's prompt over the evidence brief (the
question, its abstract, and in the reasoning-free setting the abstract's conclusion; no protocol: a role-level call has
no society), then, when the judge is on, the rationale written after the decision is fixed. So the gated decision is
the served one for the same brief and weights, and an answer that fails here (no decision at the decision position, a
refused call) is a failure the gate counts against the candidate (``served_failures``). That is also the context
``train_pi`` trains the decision in; under the JSON grammar a decision-trained adapter's whitespace drifted and it
decided after a prefix it never saw (validation AUC 0.63 under the grammar vs 0.82 at the prefix, n = 89).

**The judge's part** (``evaluate.role_judge``): the served rationale (``agents.decision.rationale_tokens``) is scored
by the society's judge with the decision, against the abstract, as it scores a rollout's (``pipeline.rewards.judge``,
no protocol). The record's reward is then the society's final reward: the judge's score and the decision credit
weighted by ``reward``, so the gate reads judge scores anchored by the label. Identical answers are judged once (an
A/A copy costs no judge call).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from pipeline.agents import decision
from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import NO_PROTOCOL, Prompts
from pipeline.config import AgentsParams, JudgeParams, RewardParams
from pipeline.contracts import Level, Metrics
from pipeline.evaluation.metrics import answer, macro_f1, summarise
from pipeline.evaluation.significance import rank_auc
from pipeline.progress import Bar
from pipeline.rewards.judge import decision_credit, final_reward
from pipeline.rewards.judge import judge as run_judge


async def decide(base_url: str, key: str, role: str, tasks: list[dict[str, Any]], agents: AgentsParams, reward: RewardParams,
                 setting: str, concurrency: int, timeout_s: float, prompts: Prompts, routing: str | None = None,
                 progress: Bar | None = None, rationale: bool = False) -> list[dict[str, Any]]:
    """One record per task (``metrics.summarise``'s fields): the role's served answer through the proxy
    (``decision.ask``, the society's own call; ``rationale``: its rationale too, which :func:`judged` scores), its
    P(GO) and its decision credit as the reward. ``prompts``: what the society renders (or a candidate prompt's);
    ``routing``: an evaluation routing table (None = the live one)."""
    sem = asyncio.Semaphore(concurrency)
    client = RoleClient.for_agents(agents, base_url, key, timeout_s, routing=routing, prompts=prompts)

    async def one(task: dict[str, Any]) -> dict[str, Any]:
        spans: list[dict[str, Any]] = []
        chat = decision.decision_messages(task, agents, setting, prompts)
        async with sem:
            got = await decision.ask(client, role, role, agents.decision, chat, chat if rationale else None, spans)
        made = got.decision.value if got.decision else None
        credit = decision_credit(made, task["final_decision"], reward)
        if progress is not None:
            progress.advance()
        return {"task_id": task["id"], "label": task["final_decision"], "decision": made, "p_go": got.p_go,
                "probs": got.probs, "rationale": got.rationale, "status": "ok" if made else "failed", "error": got.error,
                "reward": credit, "components": {"decision": credit}, "scores": {}, "turns": len(spans),
                "tokens": got.tokens, "latency_s": got.latency_s, "served_model": got.deployment}

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await client.aclose()


async def judged(base_url: str, key: str, tasks: list[dict[str, Any]], runs: list[list[dict[str, Any]]], agents: AgentsParams,
                 judge: JudgeParams, reward: RewardParams, concurrency: int, timeout_s: float, prompts: Prompts) -> int:
    """The judge's part of each record's reward, in place: every decided record's decision and rationale judged as the
    society's judge judges a rollout (the live judge, no protocol), its reward the society's final reward; an undecided
    record scores ``judge.failure_score``. Identical answers to a task (across ``runs``) are judged once; returns the
    number of judge calls."""
    by_id = {t["id"]: t for t in tasks}
    answers = {(r["task_id"], r["decision"], r.get("rationale") or "") for run in runs for r in run if r["decision"]}
    sem = asyncio.Semaphore(concurrency)
    client = RoleClient.for_agents(agents, base_url, key, timeout_s, max_tokens=judge.max_tokens, prompts=prompts)

    async def one(task_id: str, decision: str, why: str) -> tuple[tuple[str, str, str], dict[str, Any]]:
        async with sem:
            state = {"decision": {"decision": decision, "rationale": why}, "protocol": NO_PROTOCOL}
            return (task_id, decision, why), await run_judge(client, judge, reward, by_id[task_id], state, 1, [])

    try:
        scores = dict(await asyncio.gather(*(one(*a) for a in sorted(answers))))
    finally:
        await client.aclose()
    for run in runs:
        for r in run:
            res = scores.get((r["task_id"], r["decision"], r.get("rationale") or "")) if r["decision"] else None
            value = res["components"]["judge"] if res else judge.failure_score
            r["reward"], r["components"] = final_reward(value, r["decision"], r["label"], reward)
            r["scores"] = res["scores"] if res else {}
            r["judge_ok"] = bool(res and res["judge_ok"])
    return len(answers)


def auc(records: list[dict[str, Any]]) -> float | None:
    """AUC of P(GO) between yes and no questions (Mann-Whitney, ties half); None without both labels."""
    pos = [r["p_go"] for r in records if r["label"] == "yes" and r["p_go"] is not None]
    neg = [r["p_go"] for r in records if r["label"] == "no" and r["p_go"] is not None]
    return rank_auc(pos, neg) if pos and neg else None


def auc_ci(records: list[dict[str, Any]], draws: int = 1000, ci: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Stratified percentile bootstrap of the AUC (yes and no resampled apart, so every draw has both)."""
    yes = [r for r in records if r["label"] == "yes" and r["p_go"] is not None]
    no = [r for r in records if r["label"] == "no" and r["p_go"] is not None]
    if not yes or not no:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    values = [auc([yes[i] for i in rng.integers(0, len(yes), len(yes))] + [no[i] for i in rng.integers(0, len(no), len(no))])
              for _ in range(draws)]
    lo, hi = np.quantile(np.asarray(values, dtype=float), [(1 - ci) / 2, 1 - (1 - ci) / 2])
    return float(lo), float(hi)


def clopper_pearson(k: int, n: int, ci: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of k successes in n."""
    from scipy.stats import beta  # noqa: PLC0415 - control plane; a 0.3 s import only the reports need

    a = 1 - ci
    lo = float(beta.ppf(a / 2, k, n - k + 1)) if k > 0 else 0.0
    hi = float(beta.ppf(1 - a / 2, k + 1, n - k)) if k < n else 1.0
    return lo, hi


def metrics(records: list[dict[str, Any]], setting: str, draws: int = 1000, ci: float = 0.95, seed: int = 0,
            level: Level = Level.ROLE) -> Metrics:
    """``summarise``'s metrics (the gate reads them) plus what a reader compares: PubMedQA's official accuracy and
    macro-F1 over every question (three classes: DEFER answers maybe, and so does a failure), the yes/no accuracy with
    its exact interval (a failure decides nothing: it counts wrong), the failures with theirs, and at the role level the
    AUC of P(GO) with a bootstrap interval. The report's society figures are the same function at ``Level.SOCIETY``."""
    nan = float("nan")
    yes_no = [r for r in records if r["label"] in ("yes", "no")]
    right = sum(answer(r["decision"]) == r["label"] for r in yes_no)
    failed = sum(r["status"] != "ok" for r in records)
    lo, hi = clopper_pearson(right, len(yes_no), ci) if yes_no else (nan, nan)
    f_lo, f_hi = clopper_pearson(failed, len(records), ci) if records else (nan, nan)
    out = {**summarise(records, draws, ci, seed), "setting": setting, "level": level, "questions": len(records),
           "official": {"accuracy": sum(answer(r["decision"]) == r["label"] for r in records) / max(len(records), 1),
                        "macro_f1": macro_f1([r["label"] for r in records], [answer(r["decision"]) for r in records])},
           "yes_no": {"n": len(yes_no), "accuracy": right / max(len(yes_no), 1), "ci_low": lo, "ci_high": hi,
                      "majority": max(sum(r["label"] == "yes" for r in yes_no), sum(r["label"] == "no" for r in yes_no))
                      / max(len(yes_no), 1),
                      "go_share": sum(r["decision"] == "GO" for r in yes_no) / max(len(yes_no), 1)},
           "failures": {"n": failed, "of": len(records), "rate": failed / max(len(records), 1), "ci_low": f_lo,
                        "ci_high": f_hi}}
    if level == Level.ROLE:
        a_lo, a_hi = auc_ci(records, draws, ci, seed)
        out["auc"] = {"value": auc(records), "ci_low": a_lo, "ci_high": a_hi}
    return Metrics.model_validate(out)
