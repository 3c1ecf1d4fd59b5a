"""Exact binomial intervals for the benchmarks' rates and accuracies (valid at any n)."""

from __future__ import annotations

from scipy.stats import beta


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) two-sided interval for k successes in n trials: valid at any n, conservative."""
    a = (1 - level) / 2
    return (0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1)), 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k)))
