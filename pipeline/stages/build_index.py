"""Build the juniors' offline tool data from the train split only: BM25 corpus, MeSH gene/protein
headings, and human genes with their Gene Ontology annotations (``agents.knowledge``).

Train only, so validation and test scores do not depend on which split's abstracts are searchable:
each task hands the society its own abstract instead (``agents.context_chars``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import metrics_files, tracking
from pipeline.agents.gene_ontology import build_gene_table, resolve
from pipeline.agents.tools import build_index
from pipeline.config import KnowledgeParams, Params
from pipeline.data.splits import read_split
from pipeline.io import write_json

METRICS_FILE = Path("reports/index.json")


def fetch_knowledge(knowledge: KnowledgeParams) -> tuple[Path, Path] | None:
    """Local copies of the GO databases (downloaded once into the cache); None when not configured."""
    if not (knowledge.org_db and knowledge.go_db):
        return None
    cache = Path(knowledge.cache_dir).expanduser()
    return resolve(knowledge.org_db, cache), resolve(knowledge.go_db, cache)


def run(params: Params) -> dict[str, int]:
    frames = [read_split(params.validate_, "train")]
    dbs = fetch_knowledge(params.agents.knowledge)
    stats = build_index(frames, Path(params.rollouts.index_dir), build_gene_table(*dbs) if dbs else None)
    write_json(METRICS_FILE, stats)
    metrics_files.write("build_index", stats)
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--fetch-only", action="store_true", help="only download the GO databases into the cache (image builds)")


def main(args: argparse.Namespace, params: Params) -> int:
    if args.fetch_only:
        print(f"build-index: knowledge files {fetch_knowledge(params.agents.knowledge)}")
        return 0
    try:
        if args.no_mlflow:
            stats = run(params)
        else:
            with tracking.stage_run("build_index", params.mlflow):
                import mlflow  # noqa: PLC0415 - 1.2 s import, only the MLflow path needs it (not --no-mlflow, --fetch-only)

                stats = run(params)
                mlflow.log_metrics({k: float(v) for k, v in stats.items()})
    except FileNotFoundError as exc:  # its split not validated yet: one line naming it
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"build-index: {stats} -> {params.rollouts.index_dir}/")
    return 0
