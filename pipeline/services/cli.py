"""Start or stop the embedded default's local services: ``services up|down|status mlflow|airflow|all``.

vLLM workers and the proxy have their own commands (``serve``, ``proxy``); ``down all`` stops them
too so one command leaves the machine clean.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import MlflowParams, Params, ServingParams
from pipeline.services import airflow_server, mlflow_server
from pipeline.services.process import Service, http_ok, stop
from pipeline.serving import proxy, routing, stack

TRACKING = False  # python -m pipeline: starts the services itself; the CLI starts no tracking server for it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("service", choices=["mlflow", "airflow", "serving", "all"])


def main(args: argparse.Namespace, params: Params) -> int:
    names = ["mlflow", "airflow"] if args.service == "all" else [args.service]
    if args.service == "serving":
        return _serving(args.action, params.serving, params.mlflow)
    for name in names:
        if args.action == "up":
            if name == "mlflow":
                print(f"mlflow: {mlflow_server.ensure(params.mlflow)}  "
                      "(UI: open it in a browser; `mlflow runs list` with MLFLOW_TRACKING_URI set)")
            else:
                info = airflow_server.up()
                password = info["password"] or "(see " + info["password_file"] + ")"
                print(f"airflow: UI {info['url']}  user {info['user']}  password {password}  log {info['log']}")
        elif args.action == "down":
            stopped = mlflow_server.down(params.mlflow) if name == "mlflow" else airflow_server.down()
            print(f"{name}: {'stopped' if stopped else 'not running'}")
        else:
            url = (mlflow_server.tracking_uri(params.mlflow) + "/health" if name == "mlflow"
                   else f"http://{airflow_server.HOST}:{airflow_server.PORT}/api/v2/monitor/health")
            print(f"{name}: {'up' if http_ok(url) else 'down'} ({url})")
    if args.action == "down" and args.service == "all":
        _stop_serving(params.serving)
    return 0


def _serving(action: str, serving: ServingParams, mlflow: MlflowParams) -> int:
    if action == "up":
        mlflow_server.ensure(mlflow)  # the stack checks what is served against the registry's journal
        url, _ = stack.ensure(serving, mlflow)
        live = routing.active(serving)
        print(f"serving: proxy {url} (key: {serving.proxy.key_file} or $LITELLM_MASTER_KEY), "
              f"routing version {live and live['version']}")
    elif action == "down":
        stack.down(serving)
        print("serving: stopped")
    else:
        print(f"serving: proxy {'up' if http_ok(proxy.base_url(serving) + '/health/liveliness') else 'down'}; "
              f"routing {routing.active(serving)}")
    return 0


def _stop_serving(serving: ServingParams) -> None:
    """Stop vLLM workers and the proxy if the serving plane is installed (its own module owns how)."""
    home = Path(serving.home)
    for pid_file in sorted(home.glob("*.pid")) if home.exists() else []:
        if stop(Service(pid_file.stem, home)):
            print(f"{pid_file.stem}: stopped")
