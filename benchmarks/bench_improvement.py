"""Does one learning cycle improve the society? `make learn`'s figures as a report (issue #45).

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_improvement.py [--run] [--out docs/benchmarks-improvement.md]

With ``--run`` it runs ``make learn`` first (PARAMS picks the profile, as there); without, it reads what the last one
left: ``reports/learn-times.tsv`` (its step times), ``reports/train_pi/principal_investigator.json`` (the trainer and its signal),
``data/evaluation/summary.json`` (the role-level gate's evidence, challenger and A/A), ``reports/promotion.json`` (the
decisions) and ``reports/test.json`` (the champion PI before and after on the official test split, and the society as
served before and after on ``report.limit`` of its questions). It writes the
tables to ``--out`` and every figure to the JSON beside it. Each figure carries its n and an exact interval or test.
The stages' files are read through their contracts (``pipeline.contracts``), never by key path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from report import p_text, publish

from pipeline.contracts import (
    Evaluation,
    EvaluationSummary,
    Metrics,
    PromotionDecision,
    PromotionReport,
    RoleLevelFigures,
    SocietyFigures,
    TestReport,
    TrainerReport,
    read,
)

PI = "principal_investigator"
# PubMedQA (Jin et al. 2019) and its leaderboard, reasoning-required, accuracy on the 500 test questions
LITERATURE = [("majority class (yes)", 0.552), ("single human", 0.780), ("BioGPT-347M, fine-tuned", 0.782),
              ("BioGPT-Large (1.5B), fine-tuned", 0.810)]


class Cycle(BaseModel):
    """What one `make learn` left, as this report reads it."""

    date: str
    params: str
    times_s: dict[str, int]
    train_pi: TrainerReport | None  # the trainer's report (its DVC metrics file's source)
    gate: dict[str, Evaluation]
    decisions: dict[str, PromotionDecision]
    setting: str | None
    test: RoleLevelFigures | None
    society: SocietyFigures | None


def read_if_present(path: str, model: type[BaseModel] | None = None) -> Any:
    """``path`` parsed as ``model`` (its contract; plain JSON without one), or None when the run did not write it."""
    p = Path(path)
    if not p.exists():
        return None
    return read(model, p) if model else json.loads(p.read_text())


def _fmt(m: Metrics) -> list[str]:
    assert m.official and m.yes_no  # role_level.metrics sets them
    return [f"{m.questions}", f"{m.official.accuracy:.3f}", f"{m.official.macro_f1:.3f}", f"{m.yes_no.n}",
            f"{m.yes_no.accuracy:.3f} [{m.yes_no.ci_low:.3f}, {m.yes_no.ci_high:.3f}]", f"{m.yes_no.majority:.3f}",
            f"{m.yes_no.go_share:.2f}", "n/a" if m.auc is None or m.auc.value is None else str(m.auc)]


def gather() -> Cycle:
    times = {}
    if Path("reports/learn-times.tsv").exists():
        for line in Path("reports/learn-times.tsv").read_text().splitlines():
            name, _, seconds = line.rpartition("\t")
            times[name] = int(seconds)
    summary: EvaluationSummary | None = read_if_present("data/evaluation/summary.json", EvaluationSummary)
    promotion: PromotionReport | None = read_if_present("reports/promotion.json", PromotionReport)
    test: TestReport | None = read_if_present("reports/test.json", TestReport)
    return Cycle(date=datetime.now(UTC).isoformat(timespec="seconds"), params=os.environ.get("PARAMS", "params/learn.yaml"),
                 times_s=times, train_pi=read_if_present("reports/train_pi/principal_investigator.json", TrainerReport),
                 gate={k: e for k, e in (summary.roles if summary else {}).items() if e.role == PI},
                 decisions={k: d for k, d in (promotion.decisions if promotion else {}).items() if (d.role or k) == PI},
                 setting=test.setting if test else None, test=test.role_level.get(PI) if test else None,
                 society=test.society if test else None)


def _society_row(which: str, m: Metrics) -> str:
    assert m.official and m.yes_no and m.failures
    yn, f = m.yes_no, m.failures
    return (f"| {which} | {m.questions} | {f.n} ({f.rate:.2f} [{f.ci_low:.2f}, {f.ci_high:.2f}]) | "
            f"{yn.n} | {yn.accuracy:.3f} [{yn.ci_low:.3f}, {yn.ci_high:.3f}] | {m.official.accuracy:.3f} | "
            f"{m.official.macro_f1:.3f} | {m.reward.mean:.3f} |")


def society_lines(s: SocietyFigures, setting: str | None) -> list[str]:
    """The society as served on the test questions, before and after, with what its figure costs."""
    out = [f"## The society as served ({s.questions} test questions, {setting})", "",
           "The whole society through the live routing, one rollout a question, judged; a failed rollout decides nothing "
           "(wrong in the yes/no accuracy, `maybe` in PubMedQA's format). Before: the same questions with the replaced "
           "champion PI, the other roles' calls replayed from the after society's record.", "",
           "| society | questions | failed (rate [95% CP]) | yes/no n | yes/no acc. [95% CP] | official acc. | macro-F1 | "
           "mean reward |", "|---|---|---|---|---|---|---|---|"]
    if s.before is not None:
        out.append(_society_row(f"before (PI v{s.before_version})", s.before))
    out += [_society_row("after", s.after), ""]
    if s.after_vs_before is not None and (c := s.after_vs_before.correct) is not None:
        v = s.after_vs_before.served
        out += [f"Exact McNemar (two-sided), after vs before: yes/no correctness on {c.n} questions b = {c.b}, "
                f"c = {c.c}, p = {c.p_value:.3g}; served (a decision made) on {v.n}: b = {v.b}, c = {v.c}, "
                f"p = {v.p_value:.3g}.", ""]
    if (a := s.agreement_with_role_level) is not None and a.n:
        out += [f"The society's decision is the role-level decision of the same champion on **{a.same} of {a.n}** "
                "questions (the one decision path: by construction, unless a rollout failed before its PI).", ""]
    if (e := s.input_effect) is not None and e.n:
        m = e.mcnemar
        out += [f"What the protocol and the reviews do to the decision (the same weights, every rollout that reached the "
                f"PI, n = {e.n}, {e.yes_no_n} yes/no): yes/no accuracy on the brief alone {e.brief_accuracy:.3f}, "
                f"with the protocol and reviews {e.society_accuracy:.3f}; the two decisions agree on {e.agree} of "
                f"{e.n}; exact McNemar b = {m.b} (right only with them), c = {m.c}, p = {m.p_value:.3g}. "
                f"Served input: `{e.served_input}`.", ""]
    cost = s.cost
    out += [f"Cost: {cost.seconds:.0f} s for {s.questions} questions x {cost.societies} societies "
            f"({cost.seconds_per_question:.0f} s a question, the second society replaying).", ""]
    return out


def lines(doc: Cycle) -> list[str]:
    out = [f"# One learning cycle of the PI: `make learn` ({doc.setting})", "",
           f"Generated {doc.date} by `benchmarks/bench_improvement.py` from the outputs of `make learn` "
           f"(`{doc.params}`) on this host (2 CPU cores). Figures as JSON: the `.json` beside this file.", ""]
    t = doc.times_s
    if t:
        out += ["## Wall time", "", "| step | seconds |", "|---|---|", *(f"| {k} | {v} |" for k, v in t.items()), ""]
        if "total" in t:
            out += [f"**Total: {t['total'] / 60:.1f} min** (budget 60 min).", ""]
    if doc.train_pi:
        tr = doc.train_pi.model_extra or {}  # the SFT figures train_pi adds to the signal every trainer reports
        out += ["## The trainer (`train_pi`, SFT on the gold decision)", "",
                "| steps | train rows | held-out rows | loss on its own rows (before → after) | held-out loss | signal |",
                "|---|---|---|---|---|---|",
                f"| {tr.get('steps')} | {tr.get('train_rows')} | {tr.get('eval_rows')} | "
                f"{tr.get('fit_loss_before', float('nan')):.3f} → {tr.get('fit_loss_after', float('nan')):.3f} | "
                f"{tr.get('eval_loss_before', float('nan')):.3f} → {tr.get('eval_loss', float('nan')):.3f} | "
                f"{'no_signal: ' + str(doc.train_pi.no_signal_reason) if doc.train_pi.no_signal else 'learned'} |", ""]
    if doc.gate:
        out += ["## The gate: every validation question, paired with the champion", "",
                "| candidate | questions | official acc. | macro-F1 | yes/no n | yes/no acc. [95% CP] | majority | GO share | "
                "AUC of P(GO) [95% bootstrap] |", "|---|---|---|---|---|---|---|---|---|"]
        first = next(iter(doc.gate.values()))
        out.append(f"| champion v{first.champion.version} | " + " | ".join(_fmt(first.champion.metrics)) + " |")
        for key, e in doc.gate.items():
            out.append(f"| {key} v{e.candidate.version} | " + " | ".join(_fmt(e.candidate.metrics)) + " |")
        calls = max(e.cost.get("judge_calls") or 0 for e in doc.gate.values())
        reward = "gate's reward: judge + decision" if calls else "decision reward"
        out += ["", f"| candidate | paired diff ({reward}) | sign-flip p | McNemar b / c | McNemar p | decision | rule |",
                "|---|---|---|---|---|---|---|"]
        for key, e in doc.gate.items():
            d, dec = e.difference, doc.decisions.get(key)
            mc = f"{d.decision.b} / {d.decision.c} | {d.decision.p_value:.2e}" if d.decision else "n/a | n/a"
            out.append(f"| {key} | {d.mean:+.3f} (n={d.n}) | {d.p_value:.2e} | {mc} | **{dec.status if dec else '?'}** | "
                       f"{dec.rule if dec else ''} |")
        if calls:
            out += ["", f"The judge scored {calls} distinct answers (decision + rationale) for the gate's reward."]
        out.append("")
    if (test := doc.test) is not None:
        out += [f"## The official test split ({test.questions} questions, {test.setting})", "",
                "| PI | questions | official acc. | macro-F1 | yes/no n | yes/no acc. [95% CP] | majority | GO share | "
                "AUC of P(GO) [95% bootstrap] |", "|---|---|---|---|---|---|---|---|---|"]
        if test.before is not None:
            out.append(f"| before (v{test.previous_champion}) | " + " | ".join(_fmt(test.before)) + " |")
        out.append(f"| after (v{test.champion}) | " + " | ".join(_fmt(test.after)) + " |")
        if (m := test.mcnemar) is not None:
            out += ["", f"Exact McNemar, after better than before, on the {m.n} yes/no questions: b = {m.b} (only after "
                    f"right), c = {m.c} (only before right), **p {p_text(m.p_value)}**."]
        out += ["", "`maybe` is answered by DEFER (a third decision learned from the gold like the others): the official "
                "three-class metric counts it.", ""]
    if doc.society is not None:
        out += society_lines(doc.society, doc.setting)
    out += ["## Against the literature (reasoning-required, accuracy on the 500 test questions)", "",
            "| system | accuracy |", "|---|---|", *(f"| {name} | {acc:.3f} |" for name, acc in LITERATURE), "",
            "The GPU profile's target (docs/gpu.md): a ≤ 1.5B PI fine-tuned the same way, in the reasoning-required setting, "
            "at or above BioGPT-347M's 0.782.", ""]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run `make learn` first")
    ap.add_argument("--out", default="docs/benchmarks-improvement.md")
    args = ap.parse_args()
    if args.run:
        rc = subprocess.run(["make", "learn"], check=False).returncode
        if rc != 0:
            print(f"make learn exited with {rc}", file=sys.stderr)
            return rc
    doc = gather()
    publish(args.out, lines(doc), doc.model_dump(mode="json", exclude_unset=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
