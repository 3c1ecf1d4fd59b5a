"""Ingest PubMedQA PQA-L: read the source, normalise to the task table, split train/val/test.

Writes ``<data.out_dir>/{train,val,test}.parquet`` as one directory swap (a failed run keeps the
previous outputs) and ``reports/ingest.json`` (DVC metrics).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline import metrics_files
from pipeline.config import Params
from pipeline.io import atomic_dir, write_json

METRICS_FILE = Path("reports/ingest.json")


def stats(table: pd.DataFrame) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": len(table)}
    for split, part in table.groupby("split"):
        counts = part["final_decision"].fillna("<null>").value_counts()
        out[str(split)] = {"rows": len(part), **{f"label_{k}": int(v) for k, v in counts.items()}}
    return out


def run(params: Params) -> dict[str, Any]:
    from pipeline.data.pubmedqa import SPLITS, load_tasks, load_test_ids, split_tasks

    tasks = load_tasks(params.data.source, params.data.hf_split, allow=params.data.allow, sha256=params.data.source_sha256)
    test_ids = load_test_ids(params.data.test_ids, allow=params.data.allow)
    table = split_tasks(tasks, test_ids, params.split.val_fraction, params.split.seed)
    missing_test = sorted(set(test_ids) - set(tasks["id"]))
    with atomic_dir(params.data.out_dir) as tmp:
        for split in SPLITS:
            table[table["split"] == split].reset_index(drop=True).to_parquet(tmp / f"{split}.parquet", index=False)
    result = stats(table)
    result["test_ids_missing_from_source"] = len(missing_test)
    write_json(METRICS_FILE, result)
    metrics_files.write("ingest", result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true", help="skip MLflow logging (offline use)")


def main(args: argparse.Namespace, params: Params) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    with console.status(f"ingesting {params.data.source}"):
        if args.no_mlflow:
            result = run(params)
        else:
            from pipeline import tracking

            with tracking.stage_run("ingest", params):
                result = run(params)
                log_to_mlflow(params, result)
    console.print(f"[green]ingest[/]: {result['rows']} tasks -> {params.data.out_dir}/ "
                  + ", ".join(f"{s}={result.get(s, {}).get('rows', 0)}" for s in ("train", "val", "test")))
    if result["test_ids_missing_from_source"]:
        console.print(f"[yellow]warning[/]: {result['test_ids_missing_from_source']} official test ids are not in the source")
    return 0


def log_to_mlflow(params: Params, result: dict[str, Any]) -> None:
    import mlflow
    from mlflow.data.pandas_dataset import from_pandas

    mlflow.log_params({"source": params.data.source, "test_ids": params.data.test_ids,
                       "val_fraction": params.split.val_fraction, "seed": params.split.seed})
    flat = {"rows": result["rows"]}
    for split in ("train", "val", "test"):
        for key, value in result.get(split, {}).items():
            flat[f"{split}.{key}"] = value
    mlflow.log_metrics(flat)
    for split in ("train", "val", "test"):
        path = Path(params.data.out_dir) / f"{split}.parquet"
        frame = pd.read_parquet(path)
        dataset = from_pandas(frame[["id", "question", "final_decision"]], source=str(path), name=f"pubmedqa-{split}")
        mlflow.log_input(dataset, context=split)
    mlflow.log_artifact(str(METRICS_FILE))
