"""Few-shot demonstrations as an MLflow prompt optimizer: how a role's prompt learns (the ``prompt`` kind, #43).

:class:`FewShotOptimizer` is a ``BasePromptOptimizer`` that ``mlflow.genai.optimize_prompts`` runs: MLflow builds the
evaluation function (the role's predict function under a candidate template, MLflow's scorer over its answer, threads
and traces) and logs the optimization to the active run; the optimizer proposes candidates, the role's template with
``demos`` demonstrations (an earlier question and its gold decision, in a mix of GO and NO-GO that varies across
candidates) drawn from a pool of train-split questions, scores each on a dev set disjoint from the pool, and returns
the best one only when it beat the current template by more than ``min_gain``. It returns nothing otherwise, so
``optimize_prompts`` registers nothing: the signal is decided before anything reaches the registry.

Why demonstrations rather than rewrites: a rewrite needs a reflection model that writes better instructions than the
role's own, and the only model here is the 135M one being improved; demonstrations need none, and they are what the
label can check (docs/training.md; what they reach: docs/benchmarks-prompts.md). GEPA and MetaPromptOptimizer take
the same ``optimize_prompts`` call with a GPU worker's model as reflection model.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from mlflow.genai.optimize.optimizers import BasePromptOptimizer
from mlflow.genai.optimize.types import EvaluationResultRecord, PromptOptimizerOutput

from pipeline.agents import decision
from pipeline.agents.prompts import PI, REPOSITORY, brief
from pipeline.config import PromptRole
from pipeline.evaluation import role_level

RETRIES = 3
# the share of GO among a candidate's demonstrations, cycled over candidates: the mix moves the 135M PI's P(GO) more
# than which questions are shown (balanced mixes raised the base PI's mean P(GO) from 0.02 to 0.14-0.38 and flipped no
# decision; 4-5 GO of 6 flipped nearly all to GO: docs/benchmarks-prompts.md), so the search varies it
MIXES = (1 / 2, 2 / 3, 1 / 3, 5 / 6, 1 / 6)
HEADER = "Earlier questions this team decided, each with the decision its published answer supports:\n"


def fields(text: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(text) if f}


def _escaped(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def with_demos(template: str, demos: list[dict[str, Any]], setting: str, prefix: str) -> str:
    """``template`` with ``demos`` before it: each demonstration's question (and, reasoning-free, its conclusion) and
    the decision its label supports, written as the role writes it (``prefix``, the decision, the JSON closed): a
    135M model copies the form it sees, and an arrow (``-> GO``) moved no decision of the base PI where this form
    moved P(GO) (docs/benchmarks-prompts.md). Braces are escaped, so the candidate has the template's fields."""
    def answer(t: dict[str, Any]) -> str:
        return f"{prefix}{'GO' if t['final_decision'] == 'yes' else 'NO-GO'}\"\n}}"

    lines = [f"Question: {brief(t, 0, setting)}\n{answer(t)}" for t in demos]
    return HEADER + _escaped("\n".join(lines)) + "\n\n" + template


def split(tasks: list[dict[str, Any]], dev: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pool, dev): the yes/no questions shuffled by ``seed``, ``dev`` of them scoring candidates, the rest the pool the
    demonstrations come from (a demonstration never scores its own question)."""
    yes_no = sorted((t for t in tasks if t["final_decision"] in ("yes", "no")), key=lambda t: t["id"])
    random.Random(seed).shuffle(yes_no)
    return yes_no[dev:], yes_no[:dev]


def predictor(url: str, key: str, prompt: Any, role: str, agents: Any, setting: str, prefix: str,
              timeout_s: float) -> Callable[..., dict[str, Any]]:
    """The role's decision on one question through the proxy, rendered from ``prompt.template`` (MLflow patches that
    property with each candidate while it evaluates): ``{"decision", "p_go"}``."""
    client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"})

    def predict(task_id: str, question: str, contexts: list[str], long_answer: str) -> dict[str, Any]:
        task = {"id": task_id, "question": question, "contexts": contexts, "long_answer": long_answer}
        chat = decision.decision_messages(task, agents, setting, REPOSITORY.with_text(PI, prompt.template))
        body = decision.request(chat, role, prefix)
        for attempt in range(RETRIES):
            try:
                resp = client.post(f"{url}/chat/completions", json=body)
                resp.raise_for_status()
                made, p, _ = decision.read_completion(resp.json())
                return {"decision": made.value if made else None, "p_go": p}
            except httpx.HTTPError:
                if attempt == RETRIES - 1:
                    raise
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    return predict


def record(task: dict[str, Any]) -> dict[str, Any]:
    """A question as ``optimize_prompts`` takes it: the predict function's inputs and the decision the label supports."""
    return {"inputs": {"task_id": task["id"], "question": task["question"], "contexts": list(task.get("contexts") or []),
                       "long_answer": task.get("long_answer") or ""},
            "expectations": {"decision": "GO" if task["final_decision"] == "yes" else "NO-GO"}}


def decision_scorer() -> Any:
    """MLflow scorer: 1 when the decision is the one the label supports (PubMedQA's accuracy on yes/no questions)."""
    from mlflow.genai.scorers import scorer  # noqa: PLC0415 - 1 s import, only when optimizing

    @scorer(name="decision")
    def decision(outputs: Any, expectations: dict[str, Any]) -> float:
        return float(isinstance(outputs, dict) and outputs.get("decision") == expectations.get("decision"))

    return decision


@dataclass
class Scored:
    name: str  # "current" or "demos-<i>"
    score: float  # mean decision correctness over the dev questions
    auc: float | None
    decisions: list[str | None]
    demo_ids: list[str] = field(default_factory=list)


@dataclass
class FewShotOptimizer(BasePromptOptimizer):
    """Candidates = the template with demonstrations from ``pool``; the metric = MLflow's eval over the dev set."""

    cfg: PromptRole
    pool: list[dict[str, Any]]
    setting: str
    prefix: str  # what the role writes before its decision (agents.decision.prefix)
    scored: list[Scored] = field(default_factory=list)
    calls: int = 0
    seconds: float = 0.0
    status: str = ""  # trained | no_gain | no_signal

    def _score(self, eval_fn: Any, name: str, text: str, target: str, data: list[dict[str, Any]],
               demo_ids: list[str]) -> Scored:
        results: list[EvaluationResultRecord] = eval_fn({target: text}, data)
        self.calls += len(results)
        decisions = [r.outputs.get("decision") if isinstance(r.outputs, dict) else None for r in results]
        rows = [{"label": "yes" if d["expectations"]["decision"] == "GO" else "no",
                 "p_go": r.outputs.get("p_go") if isinstance(r.outputs, dict) else None}
                for d, r in zip(data, results, strict=True)]
        out = Scored(name, sum(r.score or 0.0 for r in results) / max(len(results), 1), role_level.auc(rows), decisions,
                     demo_ids)
        self.scored.append(out)
        print(f"train_prompt: {name}: dev accuracy {out.score:.3f} (n={len(results)}), AUC {out.auc}")
        return out

    def _demos(self, i: int) -> list[dict[str, Any]]:
        """Candidate ``i``'s demonstrations: its share of GO from :data:`MIXES` (cycled), questions drawn by seed."""
        rng = random.Random(f"{self.cfg.seed}-{i}")
        go = [t for t in self.pool if t["final_decision"] == "yes"]
        no = [t for t in self.pool if t["final_decision"] == "no"]
        k_go = min(len(go), max(1, min(self.cfg.demos - 1, round(self.cfg.demos * MIXES[i % len(MIXES)]))))
        picked = rng.sample(go, k_go) + rng.sample(no, min(len(no), self.cfg.demos - k_go))
        rng.shuffle(picked)
        return picked

    def optimize(self, eval_fn: Any, train_data: list[dict[str, Any]], target_prompts: dict[str, str],
                 enable_tracking: bool = True) -> PromptOptimizerOutput:
        del enable_tracking  # optimize_prompts logs the scores; the stage logs each candidate's
        (target, template), = target_prompts.items()
        t0 = time.perf_counter()
        base = self._score(eval_fn, "current", template, target, train_data, [])
        best, best_text = base, template
        for i in range(self.cfg.candidates):
            over_time = time.perf_counter() - t0 > self.cfg.max_minutes * 60
            if self.calls + len(train_data) > self.cfg.max_calls or over_time:
                print(f"train_prompt: budget spent after {i} candidate(s) ({self.calls} calls, "
                      f"{time.perf_counter() - t0:.0f} s)")
                break
            demos = self._demos(i)
            text = with_demos(template, demos, self.setting, self.prefix)
            if fields(text) != fields(template):  # the society fills the template's fields: nothing else may reach the registry
                raise ValueError(f"candidate {i}: fields {sorted(fields(text))}, the template's {sorted(fields(template))}")
            mine = self._score(eval_fn, f"demos-{i}", text, target, train_data, [t["id"] for t in demos])
            if (mine.score, mine.auc or 0.0) > (best.score, best.auc or 0.0):
                best, best_text = mine, text
        self.seconds = time.perf_counter() - t0
        if all(s.decisions == base.decisions for s in self.scored):
            self.status = "no_signal"  # no demonstration changed a single decision: the metric never varied
        elif best.score > base.score + self.cfg.min_gain:
            self.status = "trained"
        else:
            self.status = "no_gain"
        return PromptOptimizerOutput(optimized_prompts={target: best_text} if self.status == "trained" else {},
                                     initial_eval_score=base.score, final_eval_score=best.score,
                                     initial_eval_score_per_scorer={"decision": base.score},
                                     final_eval_score_per_scorer={"decision": best.score})
