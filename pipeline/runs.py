"""Open and close the MLflow parent run of one pipeline run (``make run`` and the DAG use this).

``open`` prints the pipeline run id to export as ``PIPELINE_RUN_ID`` so that every stage process
logs its child run under the same parent; ``close`` marks the parent finished or failed; ``fail``
records a failed task on it (the DAG's failure callback); ``times`` prints each stage run's wall time.
"""

from __future__ import annotations

import argparse
import os

from pipeline.config import Params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["open", "close", "fail", "times"])
    parser.add_argument("--task", default=None, help="fail: the task that failed")
    parser.add_argument("--error", default="", help="fail: why")
    parser.add_argument("--try-number", type=int, default=None)
    parser.add_argument("--run-id", default=None, help="pipeline run id (default: $PIPELINE_RUN_ID or a new one)")
    parser.add_argument("--status", default="FINISHED", choices=["FINISHED", "FAILED", "KILLED"])


def main(args: argparse.Namespace, params: Params) -> int:
    from pipeline import tracking

    if args.run_id:
        os.environ[tracking.RUN_ID_ENV] = args.run_id
    run_key = tracking.pipeline_run_id()
    mlflow_run = tracking.parent_run(params)
    if args.action == "close":
        tracking.finish_parent(params, args.status)
    if args.action == "times":
        for stage, seconds in tracking.stage_times(params):
            print(f"  {stage:<18} {seconds / 60:5.1f} min")
        return 0
    if args.action == "fail":
        if not args.task:
            print("error: `run fail` needs --task", file=__import__("sys").stderr)
            return 2
        tracking.record_failure(params, args.task, args.error, args.try_number)
    print(f"{run_key} {mlflow_run} {tracking.experiment_id(params)}")
    return 0
