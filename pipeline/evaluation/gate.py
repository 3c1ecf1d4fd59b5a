"""The promotion rule: which evidence lets a candidate replace its role's champion.

Kept apart from the stage so it reads as the policy it is and is unit-tested on its own. Rules are
checked in order and the first that fails decides, so the recorded ``rule`` says exactly why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeline.config import PromoteParams


@dataclass(frozen=True)
class Decision:
    promote: bool
    rule: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(candidate: dict[str, Any], champion: dict[str, Any], diff: dict[str, Any], cfg: PromoteParams) -> Decision:
    """``candidate``/``champion``: metrics summaries; ``diff``: the paired candidate-champion difference."""
    success = candidate.get("success_rate", {}).get("mean", 0.0)
    if success < cfg.min_success_rate:
        return Decision(False, "min_success_rate", f"success rate {success:.2f} < {cfg.min_success_rate:.2f}")
    accuracy = (candidate.get("decision_accuracy") or {}).get("mean")
    if cfg.min_decision_accuracy > 0 and (accuracy is None or accuracy < cfg.min_decision_accuracy):
        return Decision(False, "min_decision_accuracy", f"decision accuracy {accuracy} < {cfg.min_decision_accuracy:.2f}")
    gain = candidate["reward"]["mean"] - champion["reward"]["mean"]
    if gain <= cfg.margin:
        return Decision(False, "margin", f"reward {candidate['reward']['mean']:.4f} vs champion {champion['reward']['mean']:.4f}: "
                                         f"gain {gain:+.4f} is not above the margin {cfg.margin:.4f}")
    if cfg.require_significance and diff["n"] < 2:
        return Decision(False, "significance", f"paired difference {diff['mean']:+.4f} over {diff['n']} task: one task gives no "
                                               "confidence interval; raise evaluate.limit")
    if cfg.require_significance and not diff["ci_low"] > 0:
        return Decision(False, "significance", f"paired difference {diff['mean']:+.4f}, {diff['ci']:.0%} CI "
                                               f"[{diff['ci_low']:+.4f}, {diff['ci_high']:+.4f}] over {diff['n']} tasks includes 0")
    return Decision(True, "promoted", f"gain {gain:+.4f} > margin {cfg.margin:.4f}; paired CI "
                                      f"[{diff['ci_low']:+.4f}, {diff['ci_high']:+.4f}] over {diff['n']} tasks")
