"""``python -m pipeline <command>``: the one entry point shared by dvc.yaml, the DAG and users.

Command modules are imported only when chosen, so ``python -m pipeline ingest`` does not pay for
great-expectations or vLLM imports. Each module defines ``add_arguments(parser)`` and
``main(args, params) -> int``, and may define ``check(args, params)``: refusals that need no service, made before any
starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pipeline import tracking, training
from pipeline.config import ParamsError, load_params
from pipeline.contracts import ContractError
from pipeline.data.sources import SourceError
from pipeline.learning import WAYS
from pipeline.promotion import PromotionError
from pipeline.prompt_registry import PromptError
from pipeline.registry import RegistryError
from pipeline.runs import RunError
from pipeline.services import mlflow_server
from pipeline.services.process import ServiceError
from pipeline.serving.routing import RoutingError
from pipeline.versions import VersionError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ingest": ("pipeline.stages.ingest", "load PubMedQA PQA-L, normalise, split train/val/test"),
    "validate": ("pipeline.stages.validate", "great-expectations suite over the task table"),
    "materialize-model": ("pipeline.stages.materialize_model", "GGUF/hub/S3 checkpoint -> HF folder under models/"),
    "serve": ("pipeline.serving.worker", "start/stop/list vLLM workers, hot-load LoRA adapters"),
    "route": ("pipeline.serving.routing", "apply|status|rollback the proxy's versioned routing"),
    "proxy": ("pipeline.serving.proxy", "start/stop the role-routing LiteLLM proxy"),
    "build-index": ("pipeline.stages.build_index", "BM25 literature index over the PubMedQA corpus"),
    "rollouts": ("pipeline.stages.rollouts", "run the research society over train shards, write traces"),
    "datasets": ("pipeline.stages.datasets", "traces -> SFT chat data, RL prompts, supervisor bandit logs"),
    # one per kind of learning (pipeline/learning.py), each with --role ROLE of its <kind>.roles
    **{k.command: (f"pipeline.stages.{k.stage}", f"{w.doc} (--role: a role of {k.value}.roles)") for k, w in WAYS.items()},
    "register-aa": ("pipeline.stages.register_aa", "register a role's champion again as an A/A candidate (alias aa)"),
    "agl-collect": ("pipeline.rl.collect", "a few rollouts through the Agent Lightning gateway; fails on 0 triplets"),
    "evaluate": ("pipeline.stages.evaluate",
                 "each role's challenger vs its champion on the validation split (MLflow GenAI evaluation)"),
    "promote": ("pipeline.stages.promote", "judge-gated promotion: move champion + routing when a candidate wins"),
    "rollback": ("pipeline.stages.rollback", "give a role back its previous champion and routing"),
    "report": ("pipeline.stages.report", "champion society on the official test split; PubMedQA-format predictions"),
    "services": ("pipeline.services.cli", "start/stop local MLflow and Airflow"),
    "prod": ("pipeline.services.deploy",
             "deploy steps (buckets, mlflow-users); up|status|dag-run|down run infra/local/prod_stack.py, "
             "the production executor on this host"),
    "run": ("pipeline.runs", "open/close the MLflow parent run of a pipeline run"),
    "preflight": ("pipeline.preflight",
                  "check a GPU profile before a GPU job (verl config, GPU memory, routing, packages); no GPU needed"),
}


def tracks(module: object, args: argparse.Namespace) -> bool:
    """Does this command talk to the tracking server? Not with ``--no-mlflow``, not in the model plane (no MLflow
    there), not the commands that start or are services themselves (a module's ``TRACKING = False``), not the actions
    that read files only (``TRACKING(args)``)."""
    on = getattr(module, "TRACKING", True)
    return (bool(on(args) if callable(on) else on) and not getattr(args, "no_mlflow", False)
            and not getattr(args, "in_model_plane", False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="params file (default: $PIPELINE_PARAMS or params.yaml)")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top, rest = build_parser().parse_known_args(argv)
    module = importlib.import_module(COMMANDS[top.command][0])
    sub = argparse.ArgumentParser(prog=f"python -m pipeline {top.command}", description=module.__doc__)
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    path = getattr(args, "params", None) or top.params  # `preflight gpu --params FILE` names it after the command
    try:
        params = load_params(path)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.params_path = path
    tracking.CONTEXT["data.setting"] = params.data.setting
    if (kind := getattr(args, "learning", None)) is not None:  # a trainer's --role, refused before MLflow starts
        args.role = training.pick_role(params, kind, args.role)
    try:
        if (check := getattr(module, "check", None)) is not None:  # the arguments, before any service starts
            check(args, params)
        if tracks(module, args):  # the entry point starts the tracking server; library calls only connect to it
            mlflow_server.ensure(params.mlflow)
        return int(module.main(args, params) or 0)
    # a service, an input, the registry, a version, a routing table or a stage's file refused: one line naming it
    except (ServiceError, SourceError, PromotionError, PromptError, RegistryError, VersionError, RoutingError,
            ContractError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if (gone := tracking.unreachable(exc)) is None:
            raise
        print(f"error: {gone}", file=sys.stderr)
        return 1
    finally:
        _flush_mlflow_traces()


def _flush_mlflow_traces() -> None:
    """Export the traces a stage logged before its process ends: left to MLflow's exit hook, the async
    export queue can race its own thread pool's shutdown (a traceback in the stage's output, seen after
    `rollouts` in `make run`)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "flush_trace_async_logging"):
        try:
            mlflow.flush_trace_async_logging()
        except Exception as exc:  # never let bookkeeping fail a stage that succeeded
            print(f"warning: MLflow trace export did not finish: {exc}", file=sys.stderr)
