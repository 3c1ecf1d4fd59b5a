"""A role whose output the label checks, scored on that output alone: the PI's GO/NO-GO on every question.

A whole-society comparison costs minutes a task and its paired differences spread wide (sd 0.29 of the final reward):
25 tasks detect only a 0.15 gain. The PI's decision is the one output a PubMedQA label checks, so a PI candidate is
scored on its own decision for every question of a split, paired with the champion PI on the same inputs.

**What the PI sees**: the society's own PI prompt (``graph.pi_prompt``) over the evidence brief alone (the question,
its abstract, and in the reasoning-free setting the abstract's conclusion), with no protocol and no reviews. A
cached champion record of the upstream society would tie the PI's score to a protocol per question (a whole society
run each, ~3 min here), and the evidence for yes/no is in the brief; the society-level figure keeps its own n.

**One prefill**: the call continues the PI's answer from ``pi.decision_prefix`` (what the base model writes before the
decision under ``PIDecision``'s schema, ``{`` + newline + two spaces + ``"decision": "`` for SmolLM2) through the proxy
(the routed deployment answers, as in the society) and generates one token; the decision is read from its
probabilities (``p_go``): GO when P(GO) >= 1/2. That is the context ``train_pi`` trains the decision in. Under the
grammar a decision-trained adapter's whitespace drifts (it had no loss there) and it decides after a prefix it never
saw: validation AUC 0.63 under the grammar vs 0.82 at the prefix, n = 89.

**The judge's part** (``evaluate.role_judge``): the same call goes on for ``evaluate.role_rationale_tokens`` tokens after
the decision (the rest of the PI's JSON, its rationale, at temperature 0), and the society's judge scores that decision and
rationale against the abstract as it scores a rollout's (``pipeline.rewards.judge``, no protocol). The record's reward is
then the society's final reward: the judge's score and the decision credit weighted by ``reward``, so the gate reads
judge scores anchored by the label. Identical answers are judged once (an A/A copy costs no judge call).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import httpx
import numpy as np

from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import NO_PROTOCOL, pi_messages
from pipeline.config import AgentsParams, JudgeParams, RewardParams
from pipeline.evaluation.metrics import answer, macro_f1, summarise
from pipeline.rewards.judge import decision_credit, final_reward
from pipeline.rewards.judge import judge as run_judge

TOP_LOGPROBS = 20  # enough that both GO and NO are listed at the decision token
RETRIES = 3  # transport errors only; an unreadable answer is the model's and counts as no decision


def messages(task: dict[str, Any], agents: AgentsParams, setting: str, template: str | None = None) -> list[dict[str, str]]:
    return pi_messages(task, agents.context_chars, setting, template)


def request(task: dict[str, Any], agents: AgentsParams, setting: str, prefix: str, role: str, rationale_tokens: int = 0,
            template: str | None = None) -> dict[str, Any]:
    """The role's chat request for ``task``: its answer continued from the decision prefix, so the decision token is the
    one generated, in its trained context (``template``: a candidate prompt text instead of the routed one)."""
    chat = [*messages(task, agents, setting, template), {"role": "assistant", "content": prefix}]
    return {"model": role, "messages": chat, "max_tokens": 1 + rationale_tokens, "temperature": 0.0, "logprobs": True,
            "top_logprobs": TOP_LOGPROBS, "continue_final_message": True, "add_generation_prompt": False}


def decision_of(doc: dict[str, Any]) -> tuple[str | None, float | None]:
    """The decision a completion's first token makes, and its P(GO) (None, None: no decision token listed)."""
    choice = doc["choices"][0]
    prob = p_go((choice.get("logprobs") or {}).get("content") or [], at_first=True)
    return (None if prob is None else "GO" if prob >= 0.5 else "NO-GO"), prob


_RATIONALE = re.compile(r'"rationale"\s*:\s*"((?:[^"\\]|\\.)*)')


def rationale(text: str) -> str:
    """The rationale the answer went on to write after its decision ('' when it wrote none), cut where it was cut."""
    found = _RATIONALE.search(text)
    return found.group(1).replace('\\"', '"') if found else ""


def _word(token: str) -> str:
    return token.strip().lstrip('"').strip()


def p_go(content: list[dict[str, Any]], at_first: bool = False) -> float | None:
    """P(GO) where the model writes the decision, renormalised over the spellings of GO and NO listed there (whitespace
    and an opening quote stripped). ``at_first``: the first generated token is the decision position (the answer was
    continued from the decision prefix), whatever the model picked there; otherwise the first token that is GO or NO
    (a whole answer decoded under ``PIDecision``'s schema, benchmarks/bench_before_after.py). None when neither is
    among the listed alternatives."""
    for entry in content[:1] if at_first else content:
        if at_first or _word(entry.get("token") or "") in ("GO", "NO"):
            mass = {"GO": 0.0, "NO": 0.0}
            for t in entry.get("top_logprobs") or []:
                if (word := _word(t["token"])) in mass:
                    mass[word] += math.exp(t["logprob"])
            total = mass["GO"] + mass["NO"]
            return mass["GO"] / total if total > 0 else None
    return None


async def _ask(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any] | str:
    """The completion, or why the model refused the request (a 4xx: the model's answer, no decision); transport errors
    and 5xx are retried, then raised."""
    for attempt in range(RETRIES):
        try:
            resp = await http.post(url, json=body)
            if 400 <= resp.status_code < 500 and resp.status_code not in (401, 403, 404, 429):
                return f"HTTP {resp.status_code}: {resp.text[:200]}"
            resp.raise_for_status()
            return dict(resp.json())
        except httpx.HTTPError:
            if attempt == RETRIES - 1:
                raise
            await asyncio.sleep(2 ** attempt)
    raise AssertionError("unreachable")


async def decide(base_url: str, key: str, role: str, tasks: list[dict[str, Any]], agents: AgentsParams, reward: RewardParams,
                 setting: str, prefix: str, concurrency: int, timeout_s: float, routing: str | None = None,
                 progress: Any = None, rationale_tokens: int = 0, template: str | None = None) -> list[dict[str, Any]]:
    """One record per task (``metrics.summarise``'s fields): the role's decision through the proxy, its P(GO) and its
    decision credit as the reward; ``rationale_tokens`` more tokens of the answer give the rationale (:func:`judged`
    scores it). ``routing``: an evaluation routing table (None = the live one); ``template``: a candidate prompt."""
    sem = asyncio.Semaphore(concurrency)
    url = f"{base_url}/chat/completions"

    async def one(http: httpx.AsyncClient, task: dict[str, Any]) -> dict[str, Any]:
        body = request(task, agents, setting, prefix, role, rationale_tokens, template)
        if routing:
            body["metadata"] = {"routing": routing}
        async with sem:
            t0 = time.perf_counter()
            doc = await _ask(http, url, body)
            latency = time.perf_counter() - t0
        refused = doc if isinstance(doc, str) else None
        choice = {} if isinstance(doc, str) else doc["choices"][0]
        decision, prob = (None, None) if isinstance(doc, str) else decision_of(doc)
        doc = {} if isinstance(doc, str) else doc
        credit = decision_credit(decision, task["final_decision"], reward)
        if progress is not None:
            progress()
        text = (choice.get("message") or {}).get("content") or ""
        return {"task_id": task["id"], "label": task["final_decision"], "decision": decision, "p_go": prob,
                "rationale": rationale(text) if rationale_tokens else None,
                "status": "ok" if decision else "failed", "error": None if decision else refused or "no decision token",
                "reward": credit, "components": {"decision": credit}, "scores": {}, "turns": 1,
                "tokens": (doc.get("usage") or {}).get("total_tokens", 0), "latency_s": latency,
                "served_model": doc.get("model")}

    async with httpx.AsyncClient(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"}) as http:
        return list(await asyncio.gather(*(one(http, t) for t in tasks)))


async def judged(base_url: str, key: str, tasks: list[dict[str, Any]], runs: list[list[dict[str, Any]]], agents: AgentsParams,
                 judge: JudgeParams, reward: RewardParams, concurrency: int, timeout_s: float) -> int:
    """The judge's part of each record's reward, in place: every decided record's decision and rationale judged as the
    society's judge judges a rollout (the live judge, no protocol), its reward the society's final reward; an undecided
    record scores ``judge.failure_score``. Identical answers to a task (across ``runs``) are judged once; returns the
    number of judge calls."""
    by_id = {t["id"]: t for t in tasks}
    answers = {(r["task_id"], r["decision"], r.get("rationale") or "") for run in runs for r in run if r["decision"]}
    sem = asyncio.Semaphore(concurrency)
    client = RoleClient.for_agents(agents, base_url, key, timeout_s, max_tokens=judge.max_tokens)

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
    if not pos or not neg:
        return None
    p, n = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
    return float(((p > n).sum() + 0.5 * (p == n).sum()) / (p.size * n.size))


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


def metrics(records: list[dict[str, Any]], setting: str, draws: int = 1000, ci: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """``summarise``'s metrics (the gate reads them) plus what a reader compares: PubMedQA's official accuracy and
    macro-F1 over every question (three classes; the PI never answers maybe), the yes/no accuracy with its exact
    interval, and the AUC of P(GO) with a bootstrap interval."""
    out = summarise(records, draws, ci, seed)
    yes_no = [r for r in records if r["label"] in ("yes", "no")]
    right = sum(answer(r["decision"]) == r["label"] for r in yes_no)
    lo, hi = clopper_pearson(right, len(yes_no), ci) if yes_no else (float("nan"), float("nan"))
    a_lo, a_hi = auc_ci(records, draws, ci, seed)
    out.update(setting=setting, level="role", questions=len(records),
               official={"accuracy": sum(answer(r["decision"]) == r["label"] for r in records) / max(len(records), 1),
                         "macro_f1": macro_f1([r["label"] for r in records], [answer(r["decision"]) for r in records])},
               yes_no={"n": len(yes_no), "accuracy": right / max(len(yes_no), 1), "ci_low": lo, "ci_high": hi,
                       "majority": max(sum(r["label"] == "yes" for r in yes_no), sum(r["label"] == "no" for r in yes_no))
                       / max(len(yes_no), 1),
                       "go_share": sum(r["decision"] == "GO" for r in yes_no) / max(len(yes_no), 1)},
               auc={"value": auc(records), "ci_low": a_lo, "ci_high": a_hi})
    return out
