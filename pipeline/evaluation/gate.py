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


def enough_tasks(n: int, min_tasks: int, mean: float | None = None, p: float | None = None) -> Decision | None:
    """Rule 1 (``insufficient_evidence``), the one place it is written: evaluate applies it before running a society
    (a smaller evaluation is not run), the gate to every difference."""
    if n >= min_tasks:
        return None
    figures = f": the difference {mean:+.4f} (p={p:.3f})" if mean is not None and p is not None else ""
    return Decision(False, INSUFFICIENT, f"{n} paired task(s) < promote.min_tasks={min_tasks}{figures} cannot support "
                                         "a decision")


@dataclass(frozen=True)
class _Case:
    """What the rules read: both summaries, the paired difference, the gate's values, the p the gate holds."""

    candidate: Metrics
    champion: Metrics
    diff: Difference
    cfg: PromoteParams
    adjusted_p: float | None
    family: int


def _setting(c: _Case) -> Decision | None:
    if c.candidate.setting == c.champion.setting:
        return None
    return Decision(False, "setting", f"candidate evaluated in {c.candidate.setting}, champion in {c.champion.setting}: "
                                      "evaluations in different PubMedQA settings never compare")


def _insufficient(c: _Case) -> Decision | None:
    return enough_tasks(c.diff.n, c.cfg.min_tasks, c.diff.mean, c.diff.p_value)


def _served_failures(c: _Case) -> Decision | None:
    failed, before = c.candidate.failed(), c.champion.failed()
    if failed is None or before is None or failed <= before + c.cfg.max_extra_failures:
        return None
    return Decision(False, "served_failures", f"{failed} of {c.diff.n} served answers failed against the champion's "
                                              f"{before} (promote.max_extra_failures={c.cfg.max_extra_failures}): what it "
                                              "would serve fails more often, whatever its other figures say")


def _floors(c: _Case) -> Decision | None:
    success = _mean(c.candidate, "success_rate") or 0.0
    if success < c.cfg.min_success_rate:
        return Decision(False, "min_success_rate", f"success rate {success:.2f} < {c.cfg.min_success_rate:.2f}")
    accuracy = _mean(c.candidate, "decision_accuracy")
    if c.cfg.min_decision_accuracy > 0 and (accuracy is None or accuracy < c.cfg.min_decision_accuracy):
        return Decision(False, "min_decision_accuracy", f"decision accuracy {accuracy} < {c.cfg.min_decision_accuracy:.2f}")
    return None


def _discrimination(c: _Case) -> Decision | None:
    if c.cfg.min_auc is None or c.candidate.level != Level.ROLE:
        return None
    auc = c.candidate.auc
    if auc and (auc.ci_low or 0) > c.cfg.min_auc:
        return None
    shown = str(auc or "none")
    return Decision(False, "discrimination", f"AUC of P(GO) {shown}: its interval does not lie above promote.min_auc="
                                             f"{c.cfg.min_auc:g} (the decisions do not separate yes from no)")


def _accuracy_drop(c: _Case) -> Decision | None:
    judge_c, judge_b = _mean(c.candidate, "reward_judge"), _mean(c.champion, "reward_judge")
    acc_c, acc_b = _mean(c.candidate, "decision_accuracy"), _mean(c.champion, "decision_accuracy")
    if judge_c is None or judge_b is None or acc_c is None or acc_b is None:
        return None
    if judge_c <= judge_b or acc_b - acc_c <= c.cfg.max_accuracy_drop:
        return None
    return Decision(False, "accuracy_drop", f"judge reward rose {judge_b:.4f} -> {judge_c:.4f} while decision accuracy fell "
                                            f"{acc_b:.2f} -> {acc_c:.2f} "
                                            f"(more than promote.max_accuracy_drop={c.cfg.max_accuracy_drop:.2f}; "
                                            f"McNemar p={c.diff.decision.p_value if c.diff.decision else float('nan'):.3f})")


def _margin(c: _Case) -> Decision | None:
    gain = c.candidate.reward.mean - c.champion.reward.mean
    if gain > c.cfg.margin:
        return None
    return Decision(False, "margin", f"reward {c.candidate.reward.mean:.4f} vs champion {c.champion.reward.mean:.4f}: "
                                     f"gain {gain:+.4f} is not above the margin {c.cfg.margin:.4f}")


def _significance(c: _Case) -> Decision:
    """The last rule decides either way: not significant, or promoted."""
    d, p = c.diff, c.diff.p_value
    evidence = f"paired difference {d.mean:+.4f} over {d.n} tasks, sign-flip p={p:.4f}"
    if c.adjusted_p is not None and c.family > 1:
        evidence += f", Holm-adjusted over the cycle's {c.family} candidates p={c.adjusted_p:.4f}"
        p = c.adjusted_p
    evidence += f", {d.ci:.0%} bootstrap CI [{d.ci_low:+.4f}, {d.ci_high:+.4f}]"
    if c.cfg.require_significance and not p < c.cfg.alpha:
        return Decision(False, "significance", f"{evidence}: p is not below promote.alpha={c.cfg.alpha:g}")
    gain = c.candidate.reward.mean - c.champion.reward.mean
    return Decision(True, "promoted", f"gain {gain:+.4f} > margin {c.cfg.margin:.4f}; {evidence}")


RULES = (_setting, _insufficient, _served_failures, _floors, _discrimination, _accuracy_drop, _margin)  # in order


def decide(candidate: Metrics | dict[str, Any], champion: Metrics | dict[str, Any], diff: Difference | dict[str, Any],
           cfg: PromoteParams, adjusted_p: float | None = None, family: int = 1) -> Decision:
    """``candidate``/``champion``: metrics summaries; ``diff``: the paired candidate-champion difference;
    ``adjusted_p``: its p-value adjusted over the ``family`` of candidates tested with it (None: tested alone).
    The first rule of :data:`RULES` that refuses decides; a candidate none refuses meets the significance rule."""
    case = _Case(Metrics.model_validate(candidate), Metrics.model_validate(champion), Difference.model_validate(diff), cfg,
                 adjusted_p, family)
    return next((d for rule in RULES if (d := rule(case)) is not None), None) or _significance(case)


def family_p_values(p_values: dict[str, float], cfg: PromoteParams) -> tuple[dict[str, float], int]:
    """Each candidate's sign-flip p-value as the gate holds it against alpha, and the size of the family it was adjusted
    over (``decide``'s ``family``): Holm-adjusted over every candidate the cycle evaluated
    (``promote.multiplicity: holm``), or its own (family 1). The family is fixed before any rule runs: a candidate
    later refused on another rule still counts, which can only make the adjustment conservative."""
    raw = {name: float(p) for name, p in p_values.items()}
    if cfg.multiplicity == "holm":
        return holm(raw), len(raw)
    return raw, 1
