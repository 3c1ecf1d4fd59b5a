"""Metrics of one evaluated society and the paired comparison of two: bootstrap CIs to describe,
exact tests to decide (``pipeline.evaluation.significance``).

Pure functions over evaluation records (one dict per task: ``task_id``, ``label``, ``decision``,
``status``, ``reward``, ``scores``, ``turns``, ``tokens``, ``latency_s``), so the gate can be
tested on synthetic records and the numbers in MLflow, ``reports/`` and the notebook agree.
Decision metrics map GO -> yes, NO-GO -> no and DEFER -> maybe (``pipeline.schemas.Decision``); ``decision_accuracy``
counts the yes/no questions, the maybe questions are reported apart, and a rollout without a decision counts as wrong.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.contracts import Difference
from pipeline.evaluation.significance import EXACT_MAX, mcnemar_exact, sign_flip
from pipeline.schemas import ANSWER

CRITERIA = ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency")


def answer(decision: str | None) -> str:
    """The PubMedQA answer a decision stands for; no decision abstains as ``maybe``."""
    return ANSWER.get(decision or "", "maybe")


def bootstrap_ci(values: Sequence[float], n: int = 1000, ci: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (a single value or none gives a zero-width/NaN interval)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - ci) / 2, 1 - (1 - ci) / 2])
    return float(lo), float(hi)


def macro_f1(truth: Sequence[str], preds: Sequence[str]) -> float:
    """sklearn's macro-F1 (labels = those in truth or predictions), as PubMedQA's evaluation.py computes it."""
    from sklearn.metrics import f1_score  # noqa: PLC0415 - here only: the model plane reads answer() and has no sklearn

    return float(f1_score(list(truth), list(preds), average="macro")) if truth else float("nan")


def _series(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each figure's values over the records: the reward and its parts, the judge's criteria, cost, decision accuracy."""
    parts = {f"reward_{p}": [float(r["components"][p]) for r in records if p in (r.get("components") or {})]
             for p in ("judge", "decision")}  # the final reward's components (pipeline.rewards.judge.final_reward)
    return {"reward": [float(r["reward"]) for r in records], **parts,
            **{c: [float(r["scores"].get(c, 0.0)) for r in records] for c in CRITERIA},
            "success_rate": [float(r["status"] == "ok") for r in records],
            **{key: [float(r.get(key) or 0) for r in records] for key in ("turns", "tokens", "latency_s")},
            "decision_accuracy": [float(answer(r["decision"]) == r["label"]) for r in records if r["label"] in ("yes", "no")]}


def summarise(records: list[dict[str, Any]], n: int = 1000, ci: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Means with bootstrap CIs for rewards and criteria; accuracy/macro-F1 on yes/no questions."""
    out: dict[str, Any] = {"tasks": len(records)}
    for name, values in _series(records).items():
        if values:
            lo, hi = bootstrap_ci(values, n, ci, seed)
            out[name] = {"mean": statistics.fmean(values), "ci_low": lo, "ci_high": hi, "n": len(values)}
    decided = [r for r in records if r["label"] in ("yes", "no")]
    out["macro_f1"] = macro_f1([r["label"] for r in decided], [answer(r["decision"]) for r in decided]) if decided else None
    out["maybe"] = _maybe([r["decision"] for r in records if r["label"] == "maybe"])
    return out


def _maybe(decisions: list[str | None]) -> dict[str, int]:
    """What was decided on the ``maybe`` questions (no right answer among GO / NO-GO; DEFER is PubMedQA's maybe)."""
    return {"n": len(decisions), "go": decisions.count("GO"), "no_go": decisions.count("NO-GO"),
            "defer": decisions.count("DEFER")}


def paired_difference(candidate: list[dict[str, Any]], champion: list[dict[str, Any]], n: int = 1000, ci: float = 0.95,
                      seed: int = 0) -> Difference:
    """Candidate - champion over the same tasks: the reward difference with a paired bootstrap CI (to
    describe) and the exact one-sided sign-flip p-value (to decide), and the exact McNemar test of
    paired decision correctness on the yes/no-labelled tasks."""
    a = {r["task_id"]: r for r in candidate}
    b = {r["task_id"]: r for r in champion}
    if set(a) != set(b):
        raise ValueError(f"paired comparison needs the same tasks; only in candidate {sorted(set(a) - set(b))[:5]}, "
                         f"only in champion {sorted(set(b) - set(a))[:5]}")
    common = sorted(a)
    diffs = [float(a[t]["reward"]) - float(b[t]["reward"]) for t in common]
    lo, hi = bootstrap_ci(diffs, n, ci, seed)
    decided = [t for t in common if a[t]["label"] in ("yes", "no")]
    right = lambda r: answer(r["decision"]) == r["label"]  # noqa: E731
    mcnemar = mcnemar_exact([right(a[t]) for t in decided], [right(b[t]) for t in decided])
    mcnemar.accuracy_diff = (mcnemar.b - mcnemar.c) / len(decided) if decided else None
    return Difference(mean=statistics.fmean(diffs) if diffs else float("nan"), ci_low=lo, ci_high=hi, n=len(diffs), ci=ci,
                      test="sign_flip_exact" if len(diffs) <= EXACT_MAX else "sign_flip_monte_carlo",
                      p_value=sign_flip(diffs, "greater", seed=seed), decision=mcnemar)


def flat(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """MLflow metrics from a summary: ``<prefix>reward``, ``<prefix>reward_ci_low``, ..."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict) and "mean" in value:
            out[f"{prefix}{key}"] = float(value["mean"])
            out[f"{prefix}{key}_ci_low"] = float(value["ci_low"])
            out[f"{prefix}{key}_ci_high"] = float(value["ci_high"])
        elif isinstance(value, (int, float)) and value is not None:
            out[f"{prefix}{key}"] = float(value)
    return out
