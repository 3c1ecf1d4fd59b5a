"""The champion society on PubMedQA's official test split: the number people quote.

Runs after promotion, through the live routing (the champions), one rollout per question with the
judge. The test split is read here and nowhere else: no training, evaluation or gating stage has it
among its DVC deps (tests/test_dvc_pipeline.py checks). Predictions are written in PubMedQA's own
format (PMID -> yes/no/maybe; a rollout without a decision abstains as ``maybe``) next to the ground
truth of the same PMIDs, so the official ``evaluation.py`` scores a limited CPU run too; accuracy and
macro-F1 are computed the way that script does (all questions, sklearn macro over the labels seen).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import mlflow

from pipeline import metrics_files, prompt_registry, tracking
from pipeline.config import Params
from pipeline.contracts import PromotionReport
from pipeline.data.splits import load_tasks
from pipeline.evaluation import role_level, society
from pipeline.evaluation.metrics import answer, flat, macro_f1, summarise
from pipeline.evaluation.significance import mcnemar_exact
from pipeline.io import atomic_dir, write_json
from pipeline.serving import proxy, routing, stack

METRICS_FILE = Path("reports/test.json")
PROMOTION_FILE = Path("reports/promotion.json")  # promote's record: which champion this cycle replaced


def _previous_champion(role: str) -> str | None:
    """The version this cycle's promotion replaced for ``role`` (None: no promotion this cycle)."""
    if not PROMOTION_FILE.exists():
        return None
    return PromotionReport.model_validate_json(PROMOTION_FILE.read_text()).replaced(role)


# whole Params: the role's requests read agents, reward, data, pi, serving, evaluate and report
def role_level_report(params: Params, role: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``role``'s champion on its own decision over the test split (report.role_limit questions), and, when this cycle
    promoted it, the champion it replaced on the same questions: exact McNemar on the yes/no questions, both AUCs."""
    from pipeline import registry  # noqa: PLC0415 - control plane registry; only this report needs it here

    tasks = load_tasks(params.validate_, "test", params.report.role_limit, setting=params.data.setting)
    url, key = proxy.client_settings(params.serving)
    cfg = params.evaluate
    live = routing.active(params.serving) or {}
    scored: dict[str, Any] = {}
    before = _previous_champion(role)
    for which, version in (("after", None), ("before", before)):
        if which == "before" and version is None:
            continue
        table = None
        if version is not None:  # the replaced champion, reached through an evaluation table (the live one is untouched)
            where = registry.deploy(params.serving, role, registry.get_version(role, version), live["roles"].get(role))
            table = f"test-{role}-v{version}"
            routing.write_eval(params.serving, table, {**live["roles"], role: where}, live.get("policies"))
        t0 = time.perf_counter()
        records = asyncio.run(role_level.decide(url, key, role, tasks, params.agents, params.reward, params.data.setting,
                                                params.pi.decision_prefix, cfg.role_concurrency, cfg.timeout_s, table))
        scored[which] = {"records": records, "seconds": time.perf_counter() - t0,
                         "metrics": role_level.metrics(records, params.data.setting, cfg.bootstrap, cfg.ci, cfg.seed)}
    champion = registry.by_alias(role, registry.CHAMPION)
    out: dict[str, Any] = {"questions": len(tasks), "setting": params.data.setting, "maybe_answer": "never (GO/NO-GO only)",
                           "champion": champion.version if champion else None, "previous_champion": before,
                           **{w: s["metrics"] for w, s in scored.items()},
                           "seconds": {w: s["seconds"] for w, s in scored.items()}}
    if "before" in scored:
        a = {r["task_id"]: r for r in scored["after"]["records"]}
        b = {r["task_id"]: r for r in scored["before"]["records"]}
        yes_no = [t for t in sorted(a) if a[t]["label"] in ("yes", "no")]
        right = lambda r: answer(r["decision"]) == r["label"]  # noqa: E731
        test = mcnemar_exact([right(a[t]) for t in yes_no], [right(b[t]) for t in yes_no], "greater")
        out.update(mcnemar_p=test["p_value"], mcnemar={**test, "alternative": "after better than before", "n": len(yes_no)})
    after = out["after"]
    line = (f"report: {role} v{out['champion']} on {len(tasks)} test questions ({params.data.setting}): official accuracy "
            f"{after['official']['accuracy']:.3f}, macro-F1 {after['official']['macro_f1']:.3f}; yes/no accuracy "
            f"{after['yes_no']['accuracy']:.3f} [{after['yes_no']['ci_low']:.3f}, {after['yes_no']['ci_high']:.3f}] "
            f"(n={after['yes_no']['n']}, majority {after['yes_no']['majority']:.3f}), AUC {after['auc']['value']}")
    if "before" in out:
        line += (f"; before (v{before}): yes/no accuracy {out['before']['yes_no']['accuracy']:.3f}, AUC "
                 f"{out['before']['auc']['value']}; exact McNemar (after > before) p={out['mcnemar_p']:.2e}")
    print(line)
    return out, scored["after"]["records"]


def run(params: Params) -> dict[str, Any]:
    role_results: dict[str, Any] = {}
    role_records: dict[str, list[dict[str, Any]]] = {}
    if params.report.role_level:
        for role in (r for r in params.evaluate.role_level if r in params.promote.roles):
            role_results[role], role_records[role] = role_level_report(params, role)
    tasks = load_tasks(params.validate_, "test", params.report.limit, setting=params.data.setting)
    live = routing.active(params.serving)
    traces = society.run_many(params, tasks, [(live, None)], tracking.pipeline_run_id(), score=True,
                              description="report (test split)")[0]
    records = [{"task_id": t.task_id, "label": t.label, "decision": t.decision, "status": t.status, "reward": t.reward or 0.0,
                "scores": t.rewards, "turns": t.turns, "tokens": t.tokens, "latency_s": t.latency_s} for t in traces]
    predictions = {t.task_id: answer(t.decision) for t in traces}
    truth = {t["id"]: t["final_decision"] for t in tasks}
    pmids = list(truth)
    official = {"accuracy": sum(predictions[p] == truth[p] for p in pmids) / len(pmids),
                "macro_f1": macro_f1([truth[p] for p in pmids], [predictions[p] for p in pmids])}
    summary = summarise(records, params.evaluate.bootstrap, params.evaluate.ci, params.evaluate.seed)
    if params.report.predictions == "role_level" and role_records:
        rows = next(iter(role_records.values()))  # PubMedQA's format from the role-level PI: every question it answered
        predictions = {r["task_id"]: answer(r["decision"]) for r in rows}
        truth = {r["task_id"]: r["label"] for r in rows}
    society_official, society_n = official, len(pmids)
    pmids = list(truth)
    official = {"accuracy": sum(predictions[p] == truth[p] for p in pmids) / len(pmids),
                "macro_f1": macro_f1([truth[p] for p in pmids], [predictions[p] for p in pmids])}
    with atomic_dir(params.report.out_dir) as tmp:
        (tmp / "predictions.json").write_text(json.dumps(predictions, indent=1))
        (tmp / "ground_truth.json").write_text(json.dumps(truth, indent=1))
        (tmp / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        for role, rows in role_records.items():
            (tmp / f"{role}-records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"questions": len(pmids), "setting": params.data.setting, "routing_version": live["version"] if live else None,
              "official": official, "society": {"questions": society_n, "official": society_official}, **summary,
              "predictions": params.report.predictions, "role_level": role_results}
    mlflow.log_metrics({f"test.{k}": v for k, v in {**flat(summary), **official}.items()})
    mlflow.log_artifacts(params.report.out_dir, artifact_path="test")
    print(f"report: {len(pmids)} test questions, accuracy {official['accuracy']:.3f}, macro-F1 {official['macro_f1']:.3f} "
          f"(PubMedQA's evaluation.py: python evaluation.py {params.report.out_dir}/predictions.json "
          f"with data/test_ground_truth.json = {params.report.out_dir}/ground_truth.json)")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)
    prompt_registry.sync(params.mlflow, routing.active(params.serving))  # the routed prompt versions, named in spans
    with tracking.stage_run("report", params.mlflow):
        result = run(params)
    write_json(METRICS_FILE, result)
    metrics_files.write("report", result)
    return 0
