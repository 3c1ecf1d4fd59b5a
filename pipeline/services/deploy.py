"""``python -m pipeline prod buckets|mlflow-users``: the deploy steps every production stack runs from its image.

compose's ``minio-init`` and ``mlflow-init`` and their Kubernetes Jobs run them; ``make prod-stack`` runs the
same code (``pipeline.services.buckets``, ``pipeline.services.mlflow_users``).

``up|status|dag-run|down`` drive the production executor on one host without Docker, whose process code lives
with the rest of the infrastructure (``infra/local/prod_stack.py``, what ``make prod-stack|prod-run|prod-down``
run). This command runs that script in a child process and never imports it: the package does not depend on infra/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import Params
from pipeline.envs import REPO_ROOT, pythonpath
from pipeline.services import buckets, mlflow_users

TRACKING = False  # python -m pipeline: the production stack's own steps; the CLI starts no tracking server for it

PROD_STACK_SCRIPT = REPO_ROOT / "infra" / "local" / "prod_stack.py"
STACK_ACTIONS = ("up", "down", "status", "dag-run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=[*STACK_ACTIONS, "buckets", "mlflow-users"],
                        help="up|down|status|dag-run: infra/local/prod_stack.py (the stack on this host); "
                             "buckets: only the boto3 bucket bootstrap, against $AWS_ENDPOINT_URL "
                             "(compose's and k8s' init step); "
                             "mlflow-users: only MLflow's writer/reader users, against $MLFLOW_TRACKING_URI as the admin "
                             "(MLFLOW_AUTH_ADMIN_PASSWORD, MLFLOW_WRITER_PASSWORD, MLFLOW_READER_PASSWORD from the environment)")
    parser.add_argument("--conf", default="{}",
                        help="dag-run: the run's Params as JSON, e.g. '{\"tasks\": 1, \"eval_limit\": 1}'")
    parser.add_argument("--timeout-s", type=float, default=3600.0)


def main(args: argparse.Namespace, params: Params) -> int:
    if args.action == "buckets":
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - only this step talks to S3

        try:
            created = buckets.ensure(params.prod_stack.buckets, params.prod_stack.s3)
        except (BotoCoreError, ClientError) as exc:  # no keys, no endpoint, refused: one line, as every deploy step says
            print(f"error: buckets at {os.environ.get('AWS_ENDPOINT_URL') or 'AWS S3'}: {exc}", file=sys.stderr)
            return 1
        print(f"buckets: created {', '.join(created) or 'none'}; present {', '.join(params.prod_stack.buckets)}")
        return 0
    if args.action == "mlflow-users":
        return mlflow_users.users_from_env(args.timeout_s)
    argv = stack_argv(args.action, getattr(args, "params_path", None), args.conf, args.timeout_s)
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.call(argv, env=env)


def stack_argv(action: str, params_path: str | Path | None, conf: str = "{}", timeout_s: float = 3600.0) -> list[str]:
    """``infra/local/prod_stack.py`` running ``action`` with this command's params file and options."""
    argv = [sys.executable, str(PROD_STACK_SCRIPT), *(["--params", str(params_path)] if params_path else []), action]
    return [*argv, "--conf", conf, "--timeout-s", str(timeout_s)] if action == "dag-run" else argv
