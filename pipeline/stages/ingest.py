"""Ingest PubMedQA PQA-L: read the source, normalise to the task table, split train/val/test.

Writes ``<data.out_dir>/{train,val,test}.parquet`` as one directory swap (a failed run keeps the
previous outputs) and ``reports/ingest.json`` (DVC metrics), only after the rows' checks pass
(``pubmedqa.check_rows``); a bad source ends in one line naming the file, row and rule.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from pipeline import metrics_files, tracking
from pipeline.config import DataParams, Params, SplitParams
from pipeline.data.pubmedqa import SPLITS, check_rows, load_tasks, load_test_ids, split_tasks
from pipeline.io import atomic_dir, write_json

METRICS_FILE = Path("reports/ingest.json")


def stats(table: pd.DataFrame) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": len(table)}
    for split, part in table.groupby("split"):
        counts = part["final_decision"].fillna("<null>").value_counts()
        out[str(split)] = {"rows": len(part), **{f"label_{k}": int(v) for k, v in counts.items()}}
    return out


def run(params: Params) -> dict[str, Any]:
    tasks = load_tasks(params.data.source, params.data.hf_split, allow=params.data.allow, sha256=params.data.source_sha256)
    check_rows(tasks, params.data.source, params.validate_)  # before anything stored is replaced
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
    console = Console(stderr=True)
    with console.status(f"ingesting {params.data.source}"):
        if args.no_mlflow:
            result = run(params)
        else:
            with tracking.stage_run("ingest", params.mlflow):
                result = run(params)
                log_to_mlflow(params.data, params.split, result)
    console.print(f"[green]ingest[/]: {result['rows']} tasks -> {params.data.out_dir}/ "
                  + ", ".join(f"{s}={result.get(s, {}).get('rows', 0)}" for s in ("train", "val", "test")))
    if result["test_ids_missing_from_source"]:
        console.print(f"[yellow]warning[/]: {result['test_ids_missing_from_source']} official test ids are not in the source")
    return 0


def log_to_mlflow(data: DataParams, split: SplitParams, result: dict[str, Any]) -> None:
    import mlflow  # noqa: PLC0415 - 1.2 s import, only the MLflow path needs it (not --no-mlflow)
    from mlflow.data.pandas_dataset import from_pandas  # noqa: PLC0415 - as above

    mlflow.log_params({"source": data.source, "test_ids": data.test_ids,
                       "val_fraction": split.val_fraction, "seed": split.seed})
    flat = {"rows": result["rows"]}
    for name in ("train", "val", "test"):
        for key, value in result.get(name, {}).items():
            flat[f"{name}.{key}"] = value
    mlflow.log_metrics(flat)
    for name in ("train", "val", "test"):
        path = Path(data.out_dir) / f"{name}.parquet"
        frame = pd.read_parquet(path)
        with warnings.catch_warnings():
            # MLflow registers its local artifact source for both the "" and "file" schemes and warns that a path could
            # be either: the same class, so the choice changes nothing
            warnings.filterwarnings("ignore", message=".*can be interpreted in multiple ways", category=UserWarning)
            dataset = from_pandas(frame[["id", "question", "final_decision"]], source=str(path), name=f"pubmedqa-{name}")
        mlflow.log_input(dataset, context=name)
    mlflow.log_artifact(str(METRICS_FILE))
