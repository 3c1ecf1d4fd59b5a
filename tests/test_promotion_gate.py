"""The promotion rule and the evaluation statistics, on synthetic evaluation records."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeline.evaluation.gate import decide, family_p_values
from pipeline.evaluation.metrics import answer, bootstrap_ci, macro_f1, paired_difference, summarise
from pipeline.evaluation.significance import sign_flip
from tests.conftest import section


def _records(rewards: list[float], decisions: list[str | None] | None = None, labels: list[str] | None = None,
             ok: list[bool] | None = None) -> list[dict]:
    n = len(rewards)
    decisions = decisions or ["GO"] * n
    labels = labels or ["yes"] * n
    ok = ok or [True] * n
    return [{"task_id": str(i), "label": labels[i], "decision": decisions[i], "status": "ok" if ok[i] else "failed",
             "reward": r, "scores": {"groundedness": r}, "turns": 10, "tokens": 900, "latency_s": 12.0} for i, r in enumerate(rewards)]


def _compare(cand: list[dict], champ: list[dict], **cfg) -> object:
    return decide(summarise(cand, 500), summarise(champ, 500), paired_difference(cand, champ, 500), section("promote", **cfg))


def test_consistently_better_candidate_is_promoted() -> None:
    rng = random.Random(0)
    base = [rng.uniform(0.2, 0.5) for _ in range(30)]
    d = _compare(_records([b + 0.1 for b in base]), _records(base))
    assert d.promote and d.rule == "promoted" and "p=0.0000" in d.detail


def test_noisy_gain_is_not_significant() -> None:
    rng = random.Random(1)
    base = [rng.uniform(0.0, 1.0) for _ in range(8)]
    cand = [b + rng.choice([-0.5, 0.55]) for b in base]
    d = _compare(_records(cand), _records(base), min_tasks=8)
    assert not d.promote and d.rule == "significance" and "p=" in d.detail
    assert _compare(_records(cand), _records(base), min_tasks=8, require_significance=False).promote == (sum(cand) > sum(base))


def test_margin_floors_and_order_of_rules() -> None:
    base = [0.3] * 10
    assert _compare(_records([0.32] * 10), _records(base), margin=0.05, min_tasks=10).rule == "margin"
    assert _compare(_records([0.3] * 10), _records(base), min_tasks=10).rule == "margin"  # a tie never promotes
    failed = _records([0.9] * 10, ok=[True] * 4 + [False] * 6)
    assert _compare(failed, _records(base), min_tasks=10).rule == "served_failures"  # 6 failed where the champion's 0 did
    champion_failing_alike = _records(base, ok=[True] * 4 + [False] * 6)
    assert _compare(failed, champion_failing_alike, min_tasks=10).rule == "min_success_rate"
    wrong = _records([0.9] * 10, decisions=["NO-GO"] * 10)
    assert _compare(wrong, _records(base), min_decision_accuracy=0.5, min_tasks=10).rule == "min_decision_accuracy"
    assert _compare(failed, _records(base)).rule == "insufficient_evidence"  # 10 < the default min_tasks: checked first


def test_two_tasks_both_up_is_insufficient_evidence_never_significant() -> None:
    """What the old percentile bootstrap called significant: over 2 tasks its CI is [min, max] of the differences."""
    cand, champ = _records([1.0, 1.0]), _records([0.785, 0.785])
    d = _compare(cand, champ)
    assert not d.promote and d.rule == "insufficient_evidence"
    diff = paired_difference(cand, champ, 500)
    assert diff.ci_low > 0  # the bootstrap interval excludes 0...
    assert diff.p_value == pytest.approx(0.25)  # ...the exact test says p = 1/4
    assert _compare(cand, champ, min_tasks=2).rule == "significance"  # even when the floor is lowered


def test_judge_gain_bought_with_accuracy_is_rejected() -> None:
    n = 30
    labels = ["yes"] * n
    champ = _records([0.5] * n, decisions=["GO"] * n, labels=labels)
    cand = _records([0.9] * n, decisions=["GO"] * 20 + ["NO-GO"] * 10, labels=labels)
    for r, c in zip(cand, champ, strict=True):
        r["components"], c["components"] = {"judge": 0.95, "decision": float(r["decision"] == "GO")}, {"judge": 0.4, "decision": 1.0}
    d = _compare(cand, champ)
    assert not d.promote and d.rule == "accuracy_drop" and "McNemar p=" in d.detail
    assert _compare(cand, champ, max_accuracy_drop=0.5).promote  # a tolerance that allows the drop lets it through


def test_identical_models_are_never_promoted() -> None:
    """A/A: the same rewards under another version number (common random numbers make them equal)."""
    rng = random.Random(3)
    base = [rng.uniform(0.0, 1.0) for _ in range(40)]
    d = _compare(_records(list(base)), _records(base))
    assert not d.promote and d.rule == "margin"


def test_sign_flip_matches_scipy_permutation_test() -> None:
    from scipy.stats import permutation_test

    from pipeline.evaluation.significance import sign_flip

    rng = random.Random(5)
    for n in (2, 5, 9, 12):
        diffs = [rng.gauss(0.1, 0.3) for _ in range(n)]
        for alt in ("greater", "less", "two-sided"):
            ref = permutation_test((diffs,), lambda x, axis: x.mean(axis=axis), permutation_type="samples",
                                   alternative=alt, n_resamples=10**6).pvalue
            assert sign_flip(diffs, alt) == pytest.approx(ref, abs=1e-9), (n, alt)
    big = [rng.gauss(0.05, 0.3) for _ in range(40)]  # Monte Carlo above 16 tasks, close to scipy's own Monte Carlo
    ref = permutation_test((big,), lambda x, axis: x.mean(axis=axis), permutation_type="samples", alternative="greater",
                           n_resamples=20000, random_state=1).pvalue
    assert sign_flip(big, "greater") == pytest.approx(ref, abs=0.02)
    assert sign_flip([0.0] * 6, "greater") == 1.0  # no difference at all: nothing to see


def test_auc_gain_is_the_label_permutation_test_of_what_training_added_to_the_ranking() -> None:
    """``auc_gain`` (train_pi's signal check): its Monte Carlo p against every labelling enumerated; a ranking the model
    had before training is no gain, one training made is."""
    import itertools

    from pipeline.evaluation.significance import auc_gain, rank_auc

    rng = np.random.default_rng(3)
    before, after = rng.normal(size=10), rng.normal(size=10)
    positive = np.array([True] * 4 + [False] * 6)
    observed = rank_auc(after[positive], after[~positive]) - rank_auc(before[positive], before[~positive])
    gains = []
    for pick in itertools.combinations(range(10), 4):  # all 210 labellings with four positives
        pos = np.isin(np.arange(10), pick)
        gains.append(rank_auc(after[pos], after[~pos]) - rank_auc(before[pos], before[~pos]))
    exact = float(np.mean(np.asarray(gains) >= observed - 1e-12))
    b, a, p = auc_gain(before, after, positive, draws=20000)
    assert (b, a) == (rank_auc(before[positive], before[~positive]), rank_auc(after[positive], after[~positive]))
    assert p == pytest.approx(exact, abs=0.015)
    aligned = np.where(positive, 1.0, 0.0) + rng.normal(0, 0.1, 10)  # the base already ranks them: nothing was learned
    assert auc_gain(aligned, aligned, positive)[2] == 1.0
    assert auc_gain(aligned, aligned + rng.normal(0, 0.01, 10), positive)[2] > 0.05
    flat = rng.normal(0, 0.1, 40)
    labels = rng.random(40) < 0.5
    assert auc_gain(flat, flat + 2.0 * labels, labels)[2] < 0.001  # training separated them
    assert auc_gain(flat, flat, [True] * 40) == (pytest.approx(float("nan"), nan_ok=True),) * 2 + (1.0,)


def test_mcnemar_exact_matches_scipy_binomtest() -> None:
    from scipy.stats import binomtest

    from pipeline.evaluation.significance import mcnemar_exact

    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(1, 40)
        a = [rng.random() < 0.7 for _ in range(n)]
        b = [rng.random() < 0.5 for _ in range(n)]
        res = mcnemar_exact(a, b)
        m = res.b + res.c
        for alt in ("two-sided", "greater", "less"):
            got = mcnemar_exact(a, b, alt).p_value
            ref = binomtest(res.b, m, 0.5, alternative=alt).pvalue if m else 1.0
            assert got == pytest.approx(ref, abs=1e-12), (a, b, alt)


def test_mcnemar_exact_keeps_a_tiny_p_value_where_the_candidate_wins_by_far() -> None:
    """Two PIs of one recipe on the 500 test questions (docs/benchmarks-gpu-pi.md): 171 right only for one, 29 only for
    the other. The two-sided p-value is ~1e-25, not 0.0 (1 - P(X <= 170) cancels in floating point)."""
    from scipy.stats import binomtest

    from pipeline.evaluation.significance import mcnemar_exact

    a, b = [True] * 171 + [False] * 29 + [True] * 300, [False] * 171 + [True] * 29 + [True] * 300
    for alt in ("two-sided", "greater"):
        got = mcnemar_exact(a, b, alt).p_value
        assert got > 0.0
        assert got == pytest.approx(binomtest(171, 200, 0.5, alternative=alt).pvalue, rel=1e-9)


def test_holm_matches_closed_testing_with_bonferroni() -> None:
    """Holm's adjusted p of H_i is the largest Bonferroni p over every intersection of hypotheses that contains H_i
    (closed testing): checked by enumerating the intersections."""
    from itertools import combinations

    from pipeline.evaluation.significance import holm

    rng = random.Random(11)
    for _ in range(200):
        m = rng.randint(1, 5)
        p = {f"r{i}": rng.choice([rng.random(), rng.random() / 20, 0.5]) for i in range(m)}  # 0.5 repeats: ties
        closed = {k: max(min(1.0, len(s) * min(p[j] for j in s)) for r in range(1, m + 1)
                         for s in combinations(p, r) if k in s) for k in p}
        assert holm(p) == pytest.approx(closed, abs=1e-12), p
    assert holm({}) == {}


def _null_cycle(rng: np.random.Generator, roles: int, n: int) -> dict[str, dict]:
    """One cycle's summary entries for candidates identical to their champion: every candidate's rewards and the
    shared champion run are draws of the same society, so the differences share the champion's noise."""
    champion = rng.normal(0.3, 0.2, n)
    entries = {}
    for r in range(roles):
        cand = rng.normal(0.3, 0.2, n)
        d = cand - champion
        def summary(mean: float) -> dict:  # what summarise writes, as far as the gate reads it
            return {"tasks": n, "reward": {"mean": mean, "ci_low": mean, "ci_high": mean, "n": n},
                    "success_rate": {"mean": 1.0, "ci_low": 1.0, "ci_high": 1.0, "n": n}}

        entries[f"role{r}"] = {"candidate": summary(float(cand.mean())), "champion": summary(float(champion.mean())),
                               "difference": {"n": n, "mean": float(d.mean()), "p_value": sign_flip(d.tolist()),
                                              "ci": 0.95, "ci_low": 0.0, "ci_high": 0.0}}
    return entries


def _any_promoted(entries: dict[str, dict], cfg) -> bool:
    adjusted, family = family_p_values({k: e["difference"]["p_value"] for k, e in entries.items()}, cfg)
    return any(decide(e["candidate"], e["champion"], e["difference"], cfg, adjusted[k], family).promote
               for k, e in entries.items())


def test_a_cycle_of_three_null_candidates_promotes_one_at_most_alpha_of_the_time() -> None:
    """Per candidate the test holds alpha; per cycle, three null candidates tested against one champion run
    promote *one* of them far more often unless the p-values are adjusted over the cycle (promote.multiplicity)."""
    rng = np.random.default_rng(2026)
    cycles = [_null_cycle(rng, roles=3, n=12) for _ in range(1500)]
    holm_cfg, alone = section("promote", min_tasks=12), section("promote", min_tasks=12, multiplicity="none")
    assert holm_cfg.multiplicity == "holm"  # the default
    rate_holm = sum(_any_promoted(c, holm_cfg) for c in cycles) / len(cycles)
    rate_alone = sum(_any_promoted(c, alone) for c in cycles) / len(cycles)
    se = (0.05 * 0.95 / len(cycles)) ** 0.5
    assert rate_holm <= 0.05 + 2 * se, rate_holm
    assert rate_alone > 0.05 + 4 * se, rate_alone  # 0.13 here (1 - 0.95^3 = 0.14 if the tests were independent)


def test_a_real_gain_next_to_null_candidates_is_judged_on_its_holm_adjusted_p() -> None:
    """p = 0.03 passes alone; next to two candidates that did nothing (p 0.4, 0.7) Holm makes it 0.09 and the gate
    refuses it on significance, saying so; with a clear gain (p 0.001) it still passes."""
    rng = random.Random(4)
    base = [rng.uniform(0.2, 0.6) for _ in range(25)]
    cand, champ = _records([b + 0.02 for b in base]), _records(base)
    cs, bs = summarise(cand, 500), summarise(champ, 500)
    diff = paired_difference(cand, champ, 500)
    cfg = section("promote")
    for p_alone, others, promoted in ((0.03, (0.4, 0.7), False), (0.001, (0.4, 0.7), True), (0.03, (), True)):
        diff = diff.model_copy(update={"p_value": p_alone})
        family = {"senior_researcher": p_alone, **{f"r{i}": q for i, q in enumerate(others)}}
        adjusted, size = family_p_values(family, cfg)
        assert size == len(family)
        d = decide(cs, bs, diff, cfg, adjusted["senior_researcher"], size)
        assert d.promote is promoted, (p_alone, others, d)
        if others:
            assert f"Holm-adjusted over the cycle's 3 candidates p={3 * p_alone:.4f}" in d.detail
        if not promoted:
            assert d.rule == "significance"


def test_without_multiplicity_each_candidate_keeps_its_own_p_and_a_family_of_one() -> None:
    """promote.multiplicity: none: the p-values pass through unchanged and decide() is told each stood alone, so
    its detail names no Holm adjustment."""
    family = {"a": 0.03, "b": 0.4, "c": 0.7}
    assert family_p_values(family, section("promote", multiplicity="none")) == ({"a": 0.03, "b": 0.4, "c": 0.7}, 1)
    adjusted, size = family_p_values(family, section("promote"))
    assert size == 3 and adjusted["a"] == pytest.approx(0.09)


def test_min_tasks_default_is_the_power_calculation() -> None:
    from pipeline.evaluation.significance import min_tasks_for, minimum_detectable_effect

    assert section("promote").min_tasks == min_tasks_for(0.5, 0.05, 0.8) == 25  # docs/promotion.md
    assert min_tasks_for(5.0) == 5  # the exact test cannot reach p < 0.05 below 5 tasks, whatever the effect
    assert minimum_detectable_effect(0.3, 25) == pytest.approx((1.6449 + 0.8416) * 0.3 / 5, abs=1e-3)


def test_paired_difference_needs_the_same_tasks() -> None:
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(_records([0.1, 0.2]), _records([0.1, 0.2, 0.3]))


def test_decision_metrics_put_maybe_apart_and_match_sklearn() -> None:
    recs = _records([0.1] * 6, decisions=["GO", "NO-GO", None, "GO", "GO", "NO-GO"], labels=["yes", "no", "yes", "no", "maybe", "maybe"])
    s = summarise(recs, 200)
    assert s["decision_accuracy"]["mean"] == pytest.approx(2 / 4) and s["decision_accuracy"]["n"] == 4
    assert s["maybe"] == {"n": 2, "go": 1, "no_go": 1, "defer": 0}
    assert answer(None) == "maybe" and answer("GO") == "yes"
    assert s["macro_f1"] == pytest.approx(macro_f1(["yes", "no", "yes", "no"], ["yes", "no", "maybe", "yes"]))
    lo, hi = bootstrap_ci([0.5] * 5)
    assert lo == hi == 0.5


def test_a_candidate_whose_served_answers_fail_more_often_is_refused_whatever_its_other_figures() -> None:
    """#57: better rewards where it answers, but two more of its served answers fail than the champion's on the same
    tasks: refused by its own rule, before the reward is read; an identical copy is not refused for failures."""
    base = [0.3] * 30
    champion = _records(base, ok=[True] * 29 + [False])
    candidate = _records([0.9] * 30, ok=[True] * 27 + [False] * 3)
    d = _compare(candidate, champion)
    assert not d.promote and d.rule == "served_failures" and "3 of 30 served answers failed" in d.detail
    assert _compare(candidate, champion, max_extra_failures=2).promote  # the tolerance is the gate's own value
    assert _compare(champion, champion).rule == "margin"


def test_the_approval_form_shows_the_evidence_the_gate_read(tmp_path, monkeypatch) -> None:
    """#55: what a person sees in Airflow before approving: the paired difference with its interval and n, the exact
    tests (sign-flip, Holm, McNemar's b / c) and the run, read back from reports/promotion.json as promote wrote it."""
    from pipeline.contracts import PromotionDecision, PromotionReport, Status
    from pipeline.stages import promote

    rng = random.Random(3)
    base = [rng.uniform(0.2, 0.6) for _ in range(30)]
    labels = ["yes", "no"] * 15
    cand = _records([b + 0.1 for b in base], ["GO", "NO-GO"] * 15, labels)
    champ = _records(base, ["GO"] * 30, labels)
    diff = paired_difference(cand, champ, 500)
    decided = PromotionDecision(candidate="3", champion_before="2", status=Status.AWAITING_APPROVAL, rule="approval",
                                detail="the role's gate asks a person", p_value=diff.p_value, p_adjusted=diff.p_value,
                                family=1, candidate_reward=0.5, champion_reward=0.4,
                                difference=diff.model_dump(mode="json"), run_url="http://mlflow/runs/abc")
    path = tmp_path / "promotion.json"
    path.write_text(PromotionReport(promoted=[], decisions={"principal_investigator": decided}).model_dump_json())
    monkeypatch.setattr(promote, "METRICS_FILE", path)
    form = promote.approval_request("principal_investigator")
    assert form is not None and "v3 against the champion v2" in form
    assert f"paired difference {diff.mean:+.3f}, 95% CI [{diff.ci_low:+.3f}, {diff.ci_high:+.3f}], n = 30" in form
    assert diff.decision is not None and (diff.decision.b, diff.decision.c) == (15, 0)
    assert "McNemar on the decisions p = " in form and "(b = 15, c = 0, n = 30)" in form
    assert "evaluation run: http://mlflow/runs/abc" in form
    decided.status = Status.REJECTED
    path.write_text(PromotionReport(promoted=[], decisions={"principal_investigator": decided}).model_dump_json())
    assert promote.approval_request("principal_investigator") is None  # nothing awaits a person
