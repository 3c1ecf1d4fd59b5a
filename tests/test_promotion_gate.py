"""The promotion rule and the evaluation statistics, on synthetic evaluation records."""

from __future__ import annotations

import random

import pytest

from pipeline.config import PromoteParams
from pipeline.evaluation.gate import decide
from pipeline.evaluation.metrics import answer, bootstrap_ci, macro_f1, paired_difference, summarise


def _records(rewards: list[float], decisions: list[str | None] | None = None, labels: list[str] | None = None,
             ok: list[bool] | None = None) -> list[dict]:
    n = len(rewards)
    decisions = decisions or ["GO"] * n
    labels = labels or ["yes"] * n
    ok = ok or [True] * n
    return [{"task_id": str(i), "label": labels[i], "decision": decisions[i], "status": "ok" if ok[i] else "failed",
             "reward": r, "scores": {"groundedness": r}, "turns": 10, "tokens": 900, "latency_s": 12.0} for i, r in enumerate(rewards)]


def _compare(cand: list[dict], champ: list[dict], **cfg) -> object:
    return decide(summarise(cand, 500), summarise(champ, 500), paired_difference(cand, champ, 500), PromoteParams(**cfg))


def test_consistently_better_candidate_is_promoted() -> None:
    rng = random.Random(0)
    base = [rng.uniform(0.2, 0.5) for _ in range(30)]
    d = _compare(_records([b + 0.1 for b in base]), _records(base))
    assert d.promote and d.rule == "promoted"


def test_noisy_gain_is_not_significant() -> None:
    rng = random.Random(1)
    base = [rng.uniform(0.0, 1.0) for _ in range(8)]
    cand = [b + rng.choice([-0.5, 0.55]) for b in base]
    d = _compare(_records(cand), _records(base))
    assert not d.promote and d.rule == "significance" and "includes 0" in d.detail
    assert _compare(_records(cand), _records(base), require_significance=False).promote == (sum(cand) > sum(base))


def test_margin_floors_and_order_of_rules() -> None:
    base = [0.3] * 10
    assert _compare(_records([0.32] * 10), _records(base), margin=0.05).rule == "margin"
    assert _compare(_records([0.3] * 10), _records(base)).rule == "margin"  # a tie never promotes
    failed = _records([0.9] * 10, ok=[True] * 4 + [False] * 6)
    assert _compare(failed, _records(base)).rule == "min_success_rate"
    wrong = _records([0.9] * 10, decisions=["NO-GO"] * 10)
    assert _compare(wrong, _records(base), min_decision_accuracy=0.5).rule == "min_decision_accuracy"


def test_one_task_is_never_significant() -> None:
    d = _compare(_records([0.9]), _records([0.1]))
    assert not d.promote and d.rule == "significance" and "one task" in d.detail
    assert _compare(_records([0.9]), _records([0.1]), require_significance=False).promote


def test_paired_difference_needs_the_same_tasks() -> None:
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(_records([0.1, 0.2]), _records([0.1, 0.2, 0.3]))


def test_decision_metrics_put_maybe_apart_and_match_sklearn() -> None:
    recs = _records([0.1] * 6, decisions=["GO", "NO-GO", None, "GO", "GO", "NO-GO"], labels=["yes", "no", "yes", "no", "maybe", "maybe"])
    s = summarise(recs, 200)
    assert s["decision_accuracy"]["mean"] == pytest.approx(2 / 4) and s["decision_accuracy"]["n"] == 4
    assert s["maybe"] == {"n": 2, "go": 1, "no_go": 1}
    assert answer(None) == "maybe" and answer("GO") == "yes"
    assert s["macro_f1"] == pytest.approx(macro_f1(["yes", "no", "yes", "no"], ["yes", "no", "maybe", "yes"]))
    lo, hi = bootstrap_ci([0.5] * 5)
    assert lo == hi == 0.5
