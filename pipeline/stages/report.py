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
import json
from pathlib import Path
from typing import Any

import mlflow

from pipeline import metrics_files, tracking
from pipeline.config import Params
from pipeline.data.splits import load_tasks
from pipeline.evaluation import society
from pipeline.evaluation.metrics import answer, flat, macro_f1, summarise
from pipeline.io import atomic_dir, write_json
from pipeline.serving import routing, stack

METRICS_FILE = Path("reports/test.json")


def run(params: Params) -> dict[str, Any]:
    tasks = load_tasks(params.validate_, "test", params.report.limit)
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
    with atomic_dir(params.report.out_dir) as tmp:
        (tmp / "predictions.json").write_text(json.dumps(predictions, indent=1))
        (tmp / "ground_truth.json").write_text(json.dumps(truth, indent=1))
        (tmp / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = {"questions": len(pmids), "routing_version": live["version"] if live else None, "official": official, **summary}
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
    with tracking.stage_run("report", params.mlflow):
        result = run(params)
    write_json(METRICS_FILE, result)
    metrics_files.write("report", result)
    return 0
