"""The promotion rule: which evidence lets a candidate replace its role's champion.

Kept apart from the stage so it reads as the policy it is and is unit-tested on its own. Rules are
checked in order and the first that fails decides, so the recorded ``rule`` says exactly why:

0. ``setting``: the two evaluations were made in different PubMedQA settings (data.setting): never compared.
1. ``insufficient_evidence``: fewer paired tasks than ``promote.min_tasks`` (docs/promotion.md
   derives the default from a power calculation). Never promotes, whatever the numbers say.
2. ``served_failures``: the candidate's answers, asked as the society serves them, failed (no decision) on more tasks
   than the champion's on the same tasks, by more than ``promote.max_extra_failures``.
3. ``min_success_rate`` / ``min_decision_accuracy``: floors on the candidate alone; ``discrimination`` (role level,
   ``promote.min_auc``): the interval of the candidate's AUC of P(GO) must lie above the floor, so a PI that answers
   one decision everywhere (the label prior: right more often, separating nothing) is never promoted.
4. ``accuracy_drop``: the judge's part of the reward rose while decision accuracy against the
   PubMedQA label fell by more than ``promote.max_accuracy_drop`` (a candidate that learned to
   please the judge at the expense of being right).
5. ``margin``: the mean reward gain must exceed ``promote.margin``.
6. ``significance``: the exact one-sided sign-flip test of the paired reward differences must give
   p < ``promote.alpha``; with ``promote.multiplicity: holm`` that p is first Holm-adjusted over every
   candidate the cycle evaluated (the caller passes it), so a cycle of several null candidates
   promotes one of them with probability at most alpha, not about alpha per candidate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeline.config import PromoteParams
from pipeline.contracts import Difference, Level, Metrics, Status
from pipeline.evaluation.significance import holm

INSUFFICIENT = Status.INSUFFICIENT_EVIDENCE.value


@dataclass(frozen=True)
class Decision:
    promote: bool
    rule: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(summary: Metrics, key: str) -> float | None:
    stat = getattr(summary, key)
    return None if stat is None else float(stat.mean)


def decide(candidate: Metrics | dict[str, Any], champion: Metrics | dict[str, Any], diff: Difference | dict[str, Any],
           cfg: PromoteParams, adjusted_p: float | None = None, family: int = 1) -> Decision:
    """``candidate``/``champion``: metrics summaries; ``diff``: the paired candidate-champion difference;
    ``adjusted_p``: its p-value adjusted over the ``family`` of candidates tested with it (None: tested alone)."""
    candidate, champion = Metrics.model_validate(candidate), Metrics.model_validate(champion)
    diff = Difference.model_validate(diff)
    if candidate.setting != champion.setting:
        return Decision(False, "setting", f"candidate evaluated in {candidate.setting}, champion in "
                                          f"{champion.setting}: evaluations in different PubMedQA settings never compare")
    if diff.n < cfg.min_tasks:
        return Decision(False, INSUFFICIENT, f"{diff.n} paired task(s) < promote.min_tasks={cfg.min_tasks}: the difference "
                                             f"{diff.mean:+.4f} (p={diff.p_value:.3f}) cannot support a decision")
    failed, failed_before = candidate.failures(), champion.failures()
    if failed is not None and failed_before is not None and failed > failed_before + cfg.max_extra_failures:
        return Decision(False, "served_failures", f"{failed} of {diff.n} served answers failed against the champion's "
                                                  f"{failed_before} (promote.max_extra_failures={cfg.max_extra_failures}): "
                                                  "what it would serve fails more often, whatever its other figures say")
    success = _mean(candidate, "success_rate") or 0.0
    if success < cfg.min_success_rate:
        return Decision(False, "min_success_rate", f"success rate {success:.2f} < {cfg.min_success_rate:.2f}")
    accuracy = _mean(candidate, "decision_accuracy")
    if cfg.min_decision_accuracy > 0 and (accuracy is None or accuracy < cfg.min_decision_accuracy):
        return Decision(False, "min_decision_accuracy", f"decision accuracy {accuracy} < {cfg.min_decision_accuracy:.2f}")
    auc = (candidate.model_extra or {}).get("auc") if candidate.level == Level.ROLE else None
    if cfg.min_auc is not None and candidate.level == Level.ROLE and not (auc and (auc.get("ci_low") or 0) > cfg.min_auc):
        shown = "none" if not auc or auc.get("value") is None else (
            f"{auc['value']:.3f} [{auc.get('ci_low', float('nan')):.3f}, {auc.get('ci_high', float('nan')):.3f}]")
        return Decision(False, "discrimination", f"AUC of P(GO) {shown}: its interval does not lie above promote.min_auc="
                                                 f"{cfg.min_auc:g} (the decisions do not separate yes from no)")
    judge_c, judge_b = _mean(candidate, "reward_judge"), _mean(champion, "reward_judge")
    acc_b = _mean(champion, "decision_accuracy")
    if (None not in (judge_c, judge_b, accuracy, acc_b)
            and judge_c > judge_b and acc_b - accuracy > cfg.max_accuracy_drop):  # type: ignore[operator]
        return Decision(False, "accuracy_drop", f"judge reward rose {judge_b:.4f} -> {judge_c:.4f} while decision accuracy fell "
                                                f"{acc_b:.2f} -> {accuracy:.2f} "
                                                f"(more than promote.max_accuracy_drop={cfg.max_accuracy_drop:.2f}; "
                                                f"McNemar p={diff.decision.get('p_value', float('nan')):.3f})")
    gain = candidate.reward.mean - champion.reward.mean
    if gain <= cfg.margin:
        return Decision(False, "margin", f"reward {candidate.reward.mean:.4f} "
                                         f"vs champion {champion.reward.mean:.4f}: "
                                         f"gain {gain:+.4f} is not above the margin {cfg.margin:.4f}")
    p = diff.p_value
    evidence = f"paired difference {diff.mean:+.4f} over {diff.n} tasks, sign-flip p={p:.4f}"
    if adjusted_p is not None and family > 1:
        evidence += f", Holm-adjusted over the cycle's {family} candidates p={adjusted_p:.4f}"
        p = adjusted_p
    evidence += f", {diff.ci:.0%} bootstrap CI [{diff.ci_low:+.4f}, {diff.ci_high:+.4f}]"
    if cfg.require_significance and not p < cfg.alpha:
        return Decision(False, "significance", f"{evidence}: p is not below promote.alpha={cfg.alpha:g}")
    return Decision(True, "promoted", f"gain {gain:+.4f} > margin {cfg.margin:.4f}; {evidence}")


def family_p_values(p_values: dict[str, float], cfg: PromoteParams) -> tuple[dict[str, float], int]:
    """Each candidate's sign-flip p-value as the gate holds it against alpha, and the size of the family it was adjusted
    over (``decide``'s ``family``): Holm-adjusted over every candidate the cycle evaluated
    (``promote.multiplicity: holm``), or its own (family 1). The family is fixed before any rule runs: a candidate
    later refused on another rule still counts, which can only make the adjustment conservative."""
    raw = {name: float(p) for name, p in p_values.items()}
    if cfg.multiplicity == "holm":
        return holm(raw), len(raw)
    return raw, 1
