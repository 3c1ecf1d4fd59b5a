"""Start or stop the embedded default's local services: ``services up|down|status mlflow|airflow|all``.

vLLM workers and the proxy have their own commands (``serve``, ``proxy``); ``down all`` stops them
too so one command leaves the machine clean.
"""

from __future__ import annotations

import argparse

from pipeline.config import Params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("service", choices=["mlflow", "airflow", "serving", "all"])


def main(args: argparse.Namespace, params: Params) -> int:
    from pipeline.services import airflow_server, mlflow_server
    from pipeline.services.process import http_ok

    names = ["mlflow", "airflow"] if args.service == "all" else [args.service]
    if args.service == "serving":
        return _serving(args.action, params)
    for name in names:
        if args.action == "up":
            if name == "mlflow":
                print(f"mlflow: {mlflow_server.ensure(params)}  (UI: open it in a browser; `mlflow runs list` with MLFLOW_TRACKING_URI set)")
            else:
                info = airflow_server.up()
                print(f"airflow: UI {info['url']}  user {info['user']}  password {info['password'] or '(see ' + info['password_file'] + ')'}  log {info['log']}")
        elif args.action == "down":
            stopped = mlflow_server.down(params) if name == "mlflow" else airflow_server.down()
            print(f"{name}: {'stopped' if stopped else 'not running'}")
        else:
            url = mlflow_server.tracking_uri(params) + "/health" if name == "mlflow" else f"http://{airflow_server.HOST}:{airflow_server.PORT}/api/v2/monitor/health"
            print(f"{name}: {'up' if http_ok(url) else 'down'} ({url})")
    if args.action == "down" and args.service == "all":
        _stop_serving(params)
    return 0


def _serving(action: str, params: Params) -> int:
    from pipeline.services.process import http_ok
    from pipeline.serving import proxy, routing, stack

    if action == "up":
        url, _ = stack.ensure(params)
        live = routing.active(params)
        print(f"serving: proxy {url} (key: {params.serving.proxy.key_file} or $LITELLM_MASTER_KEY), routing version {live and live['version']}")
    elif action == "down":
        stack.down(params)
        print("serving: stopped")
    else:
        print(f"serving: proxy {'up' if http_ok(proxy.base_url(params) + '/health/liveliness') else 'down'}; routing {routing.active(params)}")
    return 0


def _stop_serving(params: Params) -> None:
    """Stop vLLM workers and the proxy if the serving plane is installed (its own module owns how)."""
    from pathlib import Path

    from pipeline.services.process import Service, stop

    home = Path(params.serving.home)
    for pid_file in sorted(home.glob("*.pid")) if home.exists() else []:
        if stop(Service(pid_file.stem, home)):
            print(f"{pid_file.stem}: stopped")
