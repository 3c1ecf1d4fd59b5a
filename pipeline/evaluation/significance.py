"""Paired hypothesis tests the promotion gate decides by, exact (or conservative) at the sizes used.

The percentile bootstrap the gate used before is anti-conservative at small n: over two tasks its
interval is exactly [min, max] of the differences, so "both went up" (p = 1/4 under the null) read
as significant. These two tests are valid at any n:

- ``sign_flip``: the paired permutation test of the mean difference. Under H0 (candidate and
  champion exchangeable per task) each difference's sign is a fair coin, so the p-value is the
  share of the 2^n sign patterns whose mean is at least as large as the observed one. Exact
  enumeration up to ``exact_max`` tasks, Monte Carlo above it with the (count + 1) / (draws + 1)
  correction, which keeps the Monte Carlo p-value valid (never below the exact one in expectation).
- ``mcnemar_exact``: the exact McNemar test of paired decision correctness: only discordant tasks
  (one right, the other wrong) carry information, and under H0 each goes either way with p = 1/2,
  so the p-value is a binomial tail.
- ``auc_gain``: whether training made a model rank two groups apart (the AUC of P(GO) between yes and no questions)
  better than it did before: the share of label permutations whose gain in AUC is at least the observed one. A model
  that learned only the label prior, or was trained on shuffled labels, gains nothing beyond chance.
- ``holm``: a cycle evaluates up to one candidate per role against one champion run and the gate
  tests each; with three null candidates, one passes at alpha each with probability up to
  1 - (1 - alpha)^3 (about 3 alpha). Holm's step-down adjustment keeps the chance that *any* of them
  passes at alpha, under any dependence between the tests (they share the champion's draws).

Pure numpy/stdlib so the gate runs in the control plane without scipy; the tests check both
against scipy on synthetic data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Literal

import numpy as np

from pipeline.contracts import McNemar

Alternative = Literal["greater", "less", "two-sided"]
EXACT_MAX = 16  # tasks up to which the sign-flip test enumerates all 2^n patterns (65,536 at 16)


def sign_flip(diffs: Sequence[float], alternative: Alternative = "greater", exact_max: int = EXACT_MAX, draws: int = 20000,
              seed: int = 0) -> float:
    """p-value of the paired sign-flip permutation test of mean(diffs) = 0 (1.0 for no tasks)."""
    x = np.asarray(diffs, dtype=float)
    n = x.size
    if n == 0:
        return 1.0
    observed = x.mean()
    tol = 1e-12 * max(1.0, float(np.abs(x).max()))  # ties (e.g. zero differences) count as "at least as extreme"
    if n <= exact_max:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(draws, n))
    means = signs @ x / n
    if alternative == "greater":
        hits = means >= observed - tol
    elif alternative == "less":
        hits = means <= observed + tol
    else:
        hits = np.abs(means) >= abs(observed) - tol
    count = int(hits.sum())
    return count / len(means) if n <= exact_max else (count + 1) / (draws + 1)


def rank_auc(pos: Sequence[float], neg: Sequence[float]) -> float:
    """P(a positive scores above a negative), ties half (the Mann-Whitney U over |pos| x |neg|)."""
    p, n = np.asarray(pos, dtype=float)[:, None], np.asarray(neg, dtype=float)[None, :]
    return float(((p > n).sum() + 0.5 * (p == n).sum()) / (p.size * n.size))


def auc_gain(before: Sequence[float], after: Sequence[float], positive: Sequence[bool], draws: int = 9999,
             seed: int = 0) -> tuple[float, float, float]:
    """(AUC before, AUC after, one-sided p) of "``after`` ranks the positives above the negatives better than ``before``
    does", the same items scored twice: the labels permuted ``draws`` times over both at once, with the (count + 1) /
    (draws + 1) correction; (nan, nan, 1.0) without both groups. Under H0 neither score depends on the labels, so any
    chance alignment of ``before`` with them is permuted too, and only a gain that training made counts."""
    is_pos = np.asarray(positive, dtype=bool)
    k, m = int(is_pos.sum()), int((~is_pos).sum())
    if not k or not m:
        return float("nan"), float("nan"), 1.0
    ranks = np.stack([_midranks(np.asarray(before, dtype=float)), _midranks(np.asarray(after, dtype=float))])

    def aucs(rank_sums: np.ndarray) -> np.ndarray:  # U from the positives' rank sum
        return (rank_sums - k * (k + 1) / 2) / (k * m)

    auc_before, auc_after = aucs(ranks[:, is_pos].sum(axis=1))
    picks = np.argsort(np.random.default_rng(seed).random((draws, k + m)), axis=1)[:, :k]
    gains = aucs(ranks[1][picks].sum(axis=1)) - aucs(ranks[0][picks].sum(axis=1))
    observed = auc_after - auc_before
    return float(auc_before), float(auc_after), (int((gains >= observed - 1e-12).sum()) + 1) / (draws + 1)


def _midranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    for value in np.unique(x):  # ties share their mean rank, as rank_auc counts them half
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2**n if k >= 0 else 0.0


def mcnemar_exact(candidate_right: Sequence[bool], champion_right: Sequence[bool],
                  alternative: Alternative = "two-sided") -> McNemar:
    """Exact McNemar test on paired correctness: ``b`` = tasks only the candidate got right, ``c`` = only the
    champion; p-value of b vs c under Binomial(b + c, 1/2) (1.0 with no discordant task)."""
    if len(candidate_right) != len(champion_right):
        raise ValueError(f"paired correctness needs the same tasks ({len(candidate_right)} vs {len(champion_right)})")
    b = sum(bool(a) and not bool(c) for a, c in zip(candidate_right, champion_right, strict=True))
    c = sum(bool(ch) and not bool(a) for a, ch in zip(candidate_right, champion_right, strict=True))
    m = b + c
    if m == 0:
        p = 1.0
    elif alternative == "greater":  # candidate better: b large
        # P(X >= b) as P(X <= c) (Binomial(m, 1/2) is symmetric): 1 - P(X <= b - 1) cancels to 0.0 once the tail is
        # below a double's epsilon (b = 171, c = 29 gave p = 0 where the two-sided p is 1.1e-25)
        p = _binom_cdf(c, m)
    elif alternative == "less":
        p = _binom_cdf(b, m)
    else:
        p = min(1.0, 2.0 * min(_binom_cdf(b, m), _binom_cdf(c, m)))
    return McNemar(b=b, c=c, n=len(candidate_right), p_value=float(p))


def min_tasks_for(effect_size: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Tasks a one-sided paired test needs to detect a standardized mean difference ``effect_size``
    (mean / sd of the paired differences) with the given power: the normal approximation
    n = ((z_alpha + z_power) / d)^2, raised to the smallest n at which the exact sign-flip test can
    reach ``alpha`` at all (2^-n <= alpha)."""
    z = NormalDist().inv_cdf
    n = math.ceil(((z(1 - alpha) + z(power)) / effect_size) ** 2)
    return max(n, math.ceil(math.log2(1 / alpha)))


def minimum_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest mean paired difference detectable at n tasks with the given sd of differences (normal approximation)."""
    if n < 1:
        return float("inf")
    z = NormalDist().inv_cdf
    return (z(1 - alpha) + z(power)) * sd / math.sqrt(n)


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values of a family of tests (one per key): rejecting each test whose adjusted p is below
    alpha keeps the family-wise error rate at alpha. Sorted ascending, the i-th smallest (0-based) of m is
    multiplied by m - i, and the running maximum keeps the adjusted values in the same order as the raw ones."""
    order = sorted(p_values, key=lambda key: p_values[key])
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * float(p_values[key])))
        adjusted[key] = running
    return adjusted
