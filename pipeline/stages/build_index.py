"""Build the juniors' offline tool data (BM25 corpus + MeSH gene/protein headings) from train+val."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from pipeline.config import Params
from pipeline.io import write_json

METRICS_FILE = Path("reports/index.json")


def run(params: Params) -> dict[str, int]:
    from pipeline.agents.tools import build_index

    frames = [pd.read_parquet(Path(params.validate_.out_dir) / f"{s}.parquet") for s in ("train", "val")]
    stats = build_index(frames, Path(params.rollouts.index_dir))
    write_json(METRICS_FILE, stats)
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true")


def main(args: argparse.Namespace, params: Params) -> int:
    if args.no_mlflow:
        stats = run(params)
    else:
        from pipeline import tracking

        with tracking.stage_run("build_index", params):
            import mlflow

            stats = run(params)
            mlflow.log_metrics(stats)
    print(f"build-index: {stats} -> {params.rollouts.index_dir}/")
    return 0
