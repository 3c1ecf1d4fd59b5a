"""Validate the task table with great-expectations before anything trains on it.

On failure: exit 1, print each failed expectation with its column and offending ids, keep the GX
result JSON and Data Docs under ``validate.report_dir``, and leave ``validate.out_dir`` as it was.
With ``validate.quarantine: true`` rows failing a row-level rule are moved, with their reasons, to
``<out_dir>/quarantine.parquet``; the remaining rows are validated again and table-level rules
(split sizes, label shares) still have to pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape

from pipeline import metrics_files, tracking
from pipeline.config import Params, ValidateParams
from pipeline.io import atomic_dir, write_json
from pipeline.validation.suite import failure_dicts, quarantine_reasons, run_suites

METRICS_FILE = Path("reports/validation.json")
SPLITS = ("train", "val", "test")


class ValidationFailed(RuntimeError):
    def __init__(self, messages: list[str], report_dir: str):
        self.messages = messages
        super().__init__(f"{len(messages)} expectation(s) failed (report: {report_dir}):\n"
                         + "\n".join(f"  - {m}" for m in messages))


def load_splits(in_dir: str) -> dict[str, pd.DataFrame]:
    frames = {}
    for split in SPLITS:
        path = Path(in_dir) / f"{split}.parquet"
        if not path.exists():
            raise FileNotFoundError(f"{path}: missing; run `python -m pipeline ingest` first")
        frames[split] = pd.read_parquet(path)
    return frames


def run(params: Params) -> dict[str, Any]:
    cfg = params.validate_
    report_dir = Path(cfg.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    frames = load_splits(params.data.out_dir)
    failures, raw = run_suites(frames, cfg, docs_dir=report_dir / "data_docs")
    first_pass = failures
    quarantined = pd.DataFrame(columns=["split", "id", "reasons"])
    if failures and cfg.quarantine:
        reasons = quarantine_reasons(failures)
        if reasons:
            rows = []
            for split, frame in frames.items():
                bad = frame["id"].map(lambda i, s=split: (s, str(i)) in reasons)
                for _, row in frame[bad].iterrows():
                    rows.append({"split": split, **row.to_dict(), "reasons": reasons[(split, str(row["id"]))]})
                frames[split] = frame[~bad].reset_index(drop=True)
            quarantined = pd.DataFrame(rows)
            failures, raw = run_suites(frames, cfg, docs_dir=report_dir / "data_docs")
    summary = {
        "success": not failures,
        "failed_expectations": len(failures),
        "quarantined_rows": len(quarantined),
        **{f"{s}_rows": len(f) for s, f in frames.items()},
        **{f"{s}_expectations": len(r.get("results", [])) for s, r in raw.items()},
    }
    write_json(report_dir / "gx_results.json", raw)
    write_json(report_dir / "failures.json", {"final": failure_dicts(failures), "before_quarantine": failure_dicts(first_pass)})
    write_json(METRICS_FILE, summary)
    metrics_files.write("validate", summary)
    if failures:
        raise ValidationFailed([f.describe() for f in failures], str(report_dir))
    with atomic_dir(cfg.out_dir) as tmp:
        for split, frame in frames.items():
            frame.to_parquet(tmp / f"{split}.parquet", index=False)
        quarantined.to_parquet(tmp / "quarantine.parquet", index=False)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true", help="skip MLflow logging (offline use)")


def main(args: argparse.Namespace, params: Params) -> int:
    console = Console(stderr=True)
    report_dir = Path(params.validate_.report_dir)
    try:
        with console.status("validating the task table with great-expectations"):
            if args.no_mlflow:
                summary = run(params)
            else:
                with tracking.stage_run("validate", params.mlflow):
                    try:
                        summary = run(params)
                    finally:
                        log_to_mlflow(params.validate_, report_dir)  # a failed validation is logged too
    except ValidationFailed as exc:
        console.print(f"[red]validate FAILED[/]: {len(exc.messages)} expectation(s) failed")
        for message in exc.messages:
            console.print(f"  [red]x[/] {escape(message)}", highlight=False)
        console.print(f"GX results: {report_dir / 'gx_results.json'}   "
                      f"Data Docs: {report_dir / 'data_docs' / 'index.html'}")
        return 1
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console.print(f"[green]validate[/]: all expectations passed; {summary['quarantined_rows']} row(s) quarantined; "
                  f"validated splits -> {params.validate_.out_dir}/")
    return 0


def log_to_mlflow(validate: ValidateParams, report_dir: Path) -> None:
    import mlflow  # noqa: PLC0415 - 1.2 s import, only the MLflow path needs it (not --no-mlflow)

    mlflow.log_params({"quarantine": validate.quarantine, "label_tolerance": validate.label_tolerance})
    if METRICS_FILE.exists():
        summary = json.loads(METRICS_FILE.read_text())
        mlflow.log_metrics({k: float(v) for k, v in summary.items() if isinstance(v, (int, float, bool))})
        mlflow.set_tag("validation.success", str(summary.get("success")))
    for name in ("gx_results.json", "failures.json"):
        if (report_dir / name).exists():
            mlflow.log_artifact(str(report_dir / name), artifact_path="validation")
    if (report_dir / "data_docs").exists():
        mlflow.log_artifacts(str(report_dir / "data_docs"), artifact_path="validation/data_docs")
    quarantine = Path(validate.out_dir) / "quarantine.parquet"
    if quarantine.exists():
        mlflow.log_artifact(str(quarantine), artifact_path="validation")
