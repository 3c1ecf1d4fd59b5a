"""Off-policy evaluation of a target policy from logged bandit feedback: IPS, SNIPS, DR + bootstrap CIs.

Each logged decision i has a context, the chosen candidate a_i, its logging propensity p_i and the
rollout's reward r_i. For a target policy pi with probabilities pi(a|x_i) and a reward model
q(x, a) fitted on other folds (cross-fitting, so the estimate is not scored on its own training data):

    w_i   = pi(a_i|x_i) / p_i
    IPS   = mean(w_i r_i)                      unbiased, high variance
    SNIPS = sum(w_i r_i) / sum(w_i)            self-normalised: biased, much lower variance
    DR    = mean(sum_a pi(a|x_i) q(x_i,a) + w_i (r_i - q(x_i,a_i)))   unbiased if either part is right

The logging policy evaluated the same way gives the baseline the learned policy must beat.
Confidence intervals are percentile bootstrap over decisions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ESTIMATORS = ("ips", "snips", "dr")


def _point(w: np.ndarray, r: np.ndarray, dm: np.ndarray, q_chosen: np.ndarray) -> dict[str, float]:
    ips = float(np.mean(w * r))
    snips = float(np.sum(w * r) / np.sum(w)) if np.sum(w) > 0 else 0.0
    dr = float(np.mean(dm + w * (r - q_chosen)))
    return {"ips": ips, "snips": snips, "dr": dr}


def estimate(target: Sequence[Sequence[float]], chosen: Sequence[int], propensity: Sequence[float], reward: Sequence[float],
             q: Sequence[Sequence[float]], n_boot: int = 1000, seed: int = 0, alpha: float = 0.05) -> dict[str, dict[str, float]]:
    """Point estimates and (1-alpha) bootstrap CIs of the target policy's expected reward."""
    n = len(chosen)
    if n == 0:
        raise ValueError("off-policy evaluation needs at least one logged decision")
    idx = range(n)
    a = np.asarray(chosen, dtype=int)
    p = np.asarray(propensity, dtype=float)
    if np.any(p <= 0):
        raise ValueError("logged propensities must be > 0")
    r = np.asarray(reward, dtype=float)
    pi_chosen = np.array([target[i][int(a[i])] for i in idx])
    q_chosen = np.array([q[i][int(a[i])] for i in idx])
    dm = np.array([float(np.dot(target[i], q[i])) for i in idx])
    w = pi_chosen / p
    point = _point(w, r, dm, q_chosen)
    rng = np.random.default_rng(seed)
    boots = {k: np.empty(n_boot) for k in ESTIMATORS}
    for b in range(n_boot):
        s = rng.integers(0, n, n)
        for k, v in _point(w[s], r[s], dm[s], q_chosen[s]).items():
            boots[k][b] = v
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    return {k: {"value": point[k], "ci_low": float(np.percentile(boots[k], lo)), "ci_high": float(np.percentile(boots[k], hi)),
                "mean_weight": float(np.mean(w))} for k in ESTIMATORS}
