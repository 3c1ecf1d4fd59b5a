"""What prompt optimization buys a role on CPU, next to weight training (issue #43): the PI's prompt, before and after.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_prompts.py [--run] [--out docs/benchmarks-prompts.md]

With ``--run`` it runs, in this checkout and under ``PIPELINE_PARAMS`` (default params/learn.yaml, reasoning-free):
the data and model stages (dvc repro), the serving plane, ``train-prompt``, ``evaluate`` (the PI alone at role level)
and ``promote``, timing each; without, it reads what the last run left:
``reports/train_prompt/principal_investigator.json`` (the optimizer:
dev metric before/after, calls, wall time), ``data/evaluation/summary.json`` (the gate's evidence for
``principal_investigator@prompt`` on every validation question) and ``reports/promotion.json`` (the decision). The
weight-training figures beside them come from docs/benchmarks-improvement.json (``make learn``, same setting). Tables
to ``--out``, every figure to the JSON beside it; each with its n and an exact interval or test. The stages' files are
read through their contracts (``pipeline.contracts``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench_improvement import Cycle, read_if_present
from report import write_report

from pipeline.contracts import Evaluation, EvaluationSummary, Metrics, PromotionReport
from pipeline.evaluation.role_level import clopper_pearson
from pipeline.io import write_json

PI = "principal_investigator"
KEY = f"{PI}@prompt"
# the role alone, decided on its decision (the weight benchmark's gate kept the judge's part: compared on decisions)
RUN_ENV = {"PIPELINE__EVALUATE__ONLY": "[principal_investigator]", "PIPELINE__EVALUATE__AA": "false",
           "PIPELINE__EVALUATE__ROLE_JUDGE": "false", "PIPELINE__PROMPT__CANDIDATES": "6", "PIPELINE__PROMPT__DEMOS": "6",
           "PIPELINE__PROMPT__DEV_QUESTIONS": "48", "PIPELINE__PROMPT__MAX_CALLS": "400"}
STEPS = [["dvc", "repro", "validate", "materialize_model", "build_index"],
         [sys.executable, "-m", "pipeline", "services", "up", "serving"],
         [sys.executable, "-m", "pipeline", "train-prompt"], [sys.executable, "-m", "pipeline", "evaluate"],
         [sys.executable, "-m", "pipeline", "promote"]]


def run() -> dict[str, float]:
    env = {**os.environ, "PIPELINE_PARAMS": os.environ.get("PIPELINE_PARAMS", "params/learn.yaml"), **RUN_ENV}
    times = {}
    for argv in STEPS:
        t0 = time.perf_counter()
        print(f"bench_prompts: {' '.join(argv[-2:])}", flush=True)
        subprocess.run(argv, env=env, check=True)
        times[" ".join(argv[-1:] if "pipeline" in argv else argv[:2])] = round(time.perf_counter() - t0)
    return times


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _acc(m: Metrics) -> str:
    assert m.yes_no  # role_level.metrics sets it
    return f"{m.yes_no.accuracy:.3f} [{m.yes_no.ci_low:.3f}, {m.yes_no.ci_high:.3f}] (n={m.yes_no.n})"


def _auc(m: Metrics) -> str:
    return str(m.auc) if m.auc is not None and m.auc.value is not None else "-"


def gate_lines(entry: Evaluation) -> list[str]:
    """The gate's evidence for the prompt candidate: both prompts' figures and the paired tests."""
    champ, cand, diff = entry.champion.metrics, entry.candidate.metrics, entry.difference
    assert champ.yes_no and cand.yes_no and champ.official and cand.official  # role_level.metrics sets them
    mc = diff.decision
    return [f"| | prompt v{entry.champion.version} (rendered) | prompt v{entry.candidate.version} (candidate) |",
            "|---|---|---|",
            f"| yes/no accuracy (exact CI) | {_acc(champ)} | {_acc(cand)} |",
            f"| AUC of P(GO) (bootstrap CI) | {_auc(champ)} | {_auc(cand)} |",
            f"| GO share on yes/no | {champ.yes_no.go_share:.3f} | {cand.yes_no.go_share:.3f} |",
            f"| official accuracy / macro-F1 (n={champ.questions}) | {champ.official.accuracy:.3f} / "
            f"{champ.official.macro_f1:.3f} | {cand.official.accuracy:.3f} / {cand.official.macro_f1:.3f} |",
            "", f"Paired reward difference {diff.mean:+.3f} [{diff.ci_low:+.3f}, {diff.ci_high:+.3f}] (n={diff.n}), "
            f"sign-flip p = {diff.p_value:.4f}; decisions, exact McNemar: "
            + (f"b={mc.b} c={mc.c} p = {mc.p_value:.4f} (n={mc.n})." if mc else "none (no yes/no question).")]


def weight_lines(weights: Cycle) -> list[str]:
    """``make learn``'s gate beside the prompt's (docs/benchmarks-improvement.json)."""
    g = weights.gate[PI]
    wc, wk = g.champion.metrics, g.candidate.metrics
    steps = (weights.train_pi or {}).get("steps")
    return ["", f"## Next to weight training (`make learn`, {weights.setting}, docs/benchmarks-improvement.md)", "",
            "| | base PI | PI LoRA trained on the gold decision |", "|---|---|---|",
            f"| validation yes/no accuracy | {_acc(wc)} | {_acc(wk)} |",
            f"| validation AUC of P(GO) | {_auc(wc)} | {_auc(wk)} |",
            f"| cost | - | train_pi {weights.times_s.get(f'train_pi@{PI}', 0) / 60:.1f} min ({steps} steps) |"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--out", default="docs/benchmarks-prompts.md")
    args = ap.parse_args()
    times = run() if args.run else {}
    opt = read_if_present("reports/train_prompt/principal_investigator.json")
    summary: EvaluationSummary | None = read_if_present("data/evaluation/summary.json", EvaluationSummary)
    promo: PromotionReport | None = read_if_present("reports/promotion.json", PromotionReport)
    weights: Cycle | None = read_if_present("docs/benchmarks-improvement.json", Cycle)
    if not opt:
        print("error: reports/train_prompt/principal_investigator.json missing: run with --run", file=sys.stderr)
        return 1
    entry = summary.roles.get(KEY) if summary else None
    decision = promo.decisions.get(KEY) if promo else None
    dev = opt.get("dev") or {}
    lines = [f"# Prompt optimization on CPU: the PI's prompt ({opt.get('setting')})", "",
             f"Generated {datetime.now(UTC).isoformat(timespec='seconds')} by `benchmarks/bench_prompts.py"
             f"{' --run' if args.run else ''}` (PIPELINE_PARAMS={os.environ.get('PIPELINE_PARAMS', 'params/learn.yaml')}, "
             "overrides in its RUN_ENV); SmolLM2-135M-Instruct behind vLLM (CPU), 2 cores.", "",
             "## The optimizer (`train_prompt`, train-split questions only)", "",
             "| figure | value |", "|---|---|",
             f"| optimizer | {opt.get('optimizer')} via `mlflow.genai.optimize_prompts`, {len(opt.get('candidates', [])) - 1} "
             f"candidate(s) from a pool of {opt.get('pool')} questions |",
             f"| status | {opt.get('status')}{': ' + opt['no_signal_reason'] if opt.get('no_signal_reason') else ''} |"]
    if dev:
        lo_b, hi_b = clopper_pearson(round(dev["before"] * dev["n"]), dev["n"])
        lo_a, hi_a = clopper_pearson(round(dev["after"] * dev["n"]), dev["n"])
        lines += [f"| dev accuracy, current prompt v{opt.get('base_version')} | {dev['before']:.3f} [{lo_b:.3f}, {hi_b:.3f}] "
                  f"(n={dev['n']}, exact) |",
                  f"| dev accuracy, best candidate (selected on these questions: biased upward) | {dev['after']:.3f} "
                  f"[{lo_a:.3f}, {hi_a:.3f}] |",
                  f"| dev AUC of P(GO), before / after | {_r(dev.get('auc_before'))} / {_r(dev.get('auc_after'))} |"]
    lines += [f"| cost | {opt.get('calls')} metric calls (one PI call each), {opt.get('seconds', 0) / 60:.1f} min |",
              f"| registered | {'prompts:/society.' + PI + '/' + str(opt['version']) if opt.get('version') else 'nothing'} |",
              "", "Each candidate on the dev questions:", "", "| candidate | dev accuracy | dev AUC |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['score']:.3f} | {_r(c['auc'])} |"
              for c in opt.get("candidates", [])]
    lines += ["", "## The gate (validation split, every question; champion weights under both prompts)", ""]
    if entry:
        lines += gate_lines(entry)
    else:
        lines.append("Not evaluated: the optimizer registered no candidate this run.")
    if decision:
        lines += ["", f"Decision: **{decision.status}** ({decision.rule}): {decision.detail}"]
    if weights:
        lines += weight_lines(weights)
    times = times or (read_if_present(str(Path(args.out).with_suffix(".json"))) or {}).get("times_s") or {}
    if times:
        lines += ["", "Step wall times (s): " + ", ".join(f"{k} {v}" for k, v in times.items())]
    write_report(args.out, [*lines, ""])
    gate = entry.model_dump(mode="json", exclude={"records"}) if entry else None
    write_json(Path(args.out).with_suffix(".json"), {"optimizer": opt, "times_s": times, "gate": gate,
                                                      "decision": decision.model_dump(mode="json") if decision else None})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
