"""The LiteLLM proxy every agent talks to: ``proxy up|down|status``.

Agents know only its URL, its key and the logical role names. The proxy config registers every
backend deployment statically (``<worker>`` for a worker's base model and ``<worker>/<adapter>``
for any adapter on it, through a wildcard, so hot-loaded adapters need no proxy restart); which
deployment a role name means is decided per request by ``pipeline.serving.role_router`` from the
active routing version (``pipeline.serving.routing``). The proxy process is never restarted to
change routing, so no in-flight request is dropped.

Key: ``LITELLM_MASTER_KEY`` from the environment (production); otherwise one is generated once
into ``serving.proxy.key_file`` (mode 0600). The proxy listens on ``serving.proxy.host``
(loopback by default).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import Params, ServingParams
from pipeline.envs import pythonpath
from pipeline.io import write_text
from pipeline.services.process import Service, ServiceError, claim, http_ok, start, stop
from pipeline.serving import keys
from pipeline.serving.worker import KEY_ENV as WORKER_KEY_ENV
from pipeline.serving.worker import api_key as worker_key
from pipeline.serving.worker import served_name

TRACKING = False  # python -m pipeline: the proxy process; the CLI starts no tracking server for it

KEY_ENV = "LITELLM_MASTER_KEY"


def api_key(serving: ServingParams) -> str:
    """The proxy key: from the environment, else the local key file (created 0600 on first use)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    return keys.read_or_create(serving.proxy.key_file)


def base_url(serving: ServingParams) -> str:
    return f"http://{serving.proxy.host}:{serving.proxy.port}"


def client_settings(serving: ServingParams) -> tuple[str, str]:
    """(OpenAI base URL, key) for agents: all they need to reach every role."""
    return f"{base_url(serving)}/v1", api_key(serving)


def deployments(serving: ServingParams) -> dict[str, dict[str, Any]]:
    """Deployment name -> litellm_params, for every worker in ``serving.workers`` (running or not)."""
    out: dict[str, dict[str, Any]] = {}
    for worker in serving.workers:
        api_base = f"http://{worker.host}:{worker.port}/v1"
        # workers that require a key (VLLM_API_KEY, or a local worker's key file) get it from the proxy's environment only
        api_key = f"os.environ/{WORKER_KEY_ENV}" if worker_key(worker) else "none"
        common = {"api_base": api_base, "api_key": api_key, "timeout": serving.proxy.request_timeout_s}
        out[worker.name] = {"model": f"hosted_vllm/{served_name(worker)}", **common}
        out[f"{worker.name}/*"] = {"model": "hosted_vllm/*", **common}
    return out


def active_file(serving: ServingParams) -> Path:
    return Path(serving.home).resolve() / "routing" / "active.json"


def config(serving: ServingParams) -> dict[str, Any]:
    """The proxy's litellm config, from params alone (routing lives in ``active.json``, read per request). It names
    keys by environment variable only, so it can sit in a file and in the service's recorded identity."""
    return {
        "model_list": [{"model_name": name, "litellm_params": lp} for name, lp in deployments(serving).items()],
        "litellm_settings": {"callbacks": "pipeline.serving.role_router.role_router", "drop_params": False,
                             "request_timeout": serving.proxy.request_timeout_s},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY",
                             "custom_auth": "pipeline.serving.auth.user_api_key_auth"},
    }


def write_config(serving: ServingParams) -> Path:
    path = Path(serving.home).resolve() / "litellm.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, yaml.safe_dump(config(serving), sort_keys=False))
    return path


def _env(serving: ServingParams) -> dict[str, str]:
    return {KEY_ENV: api_key(serving), **_worker_key(serving), "PIPELINE_ROUTING_ACTIVE": str(active_file(serving)),
            "PYTHONPATH": pythonpath(),
            "LITELLM_LOG": os.environ.get("LITELLM_LOG", "ERROR"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            # no Swagger, ReDoc or OpenAPI schema: every route the proxy serves asks for its key
            "NO_DOCS": "True", "NO_REDOC": "True", "NO_OPENAPI": "True"}


def _worker_key(serving: ServingParams) -> dict[str, str]:
    """``VLLM_API_KEY`` for the proxy's process: the one key the workers require (the proxy's deployments name that
    variable). Workers keyed differently cannot sit behind one proxy: refused, naming them."""
    found = {w.name: k for w in serving.workers if (k := worker_key(w))}
    if len(set(found.values())) > 1:
        raise ServiceError(f"serving.workers {sorted(found)} require different keys; the proxy holds one {WORKER_KEY_ENV} "
                           "(give them one key_file, or one VLLM_API_KEY)")
    return {WORKER_KEY_ENV: next(iter(found.values()))} if found else {}


def _command(serving: ServingParams, host: str) -> list[str]:
    litellm = str(Path(sys.executable).with_name("litellm"))
    return [litellm, "--config", str(write_config(serving)), "--host", host, "--port", str(serving.proxy.port),
            "--num_workers", "1"]


def up(serving: ServingParams, host: str | None = None) -> str:
    """Start the proxy unless it answers; a proxy on another host (compose, Kubernetes) is only health-checked."""
    url = base_url(serving)
    health = f"{url}/health/liveliness"
    if serving.proxy.host not in ("127.0.0.1", "localhost"):
        if http_ok(health):
            return url
        raise ServiceError(f"proxy at {url} is remote and not healthy; it is not started from here")
    service = Service("proxy", Path(serving.home).resolve())
    host = host or serving.proxy.host
    env = _env(serving)
    # everything it is started with but its keys: a proxy left running with other deployments (a worker added or moved,
    # another timeout) is restarted, not reused answering from the old config (the workers' rule: serving/worker.py)
    secrets = {k: v for k, v in env.items() if k in (KEY_ENV, WORKER_KEY_ENV)}  # compared in its environment, never recorded
    identity = {"config_file": str(Path(serving.home).resolve() / "litellm.yaml"), "config": config(serving), "host": host,
                "port": serving.proxy.port, "env": {k: v for k, v in env.items() if k not in secrets}}
    if claim(service, identity, serving.proxy.host, serving.proxy.port, health, "serving.proxy.port", secrets=secrets):
        return url
    start(service, _command(serving, host), health, env=env, timeout_s=180, meta={"url": url}, identity=identity,
          secrets=secrets)
    return url


def down(serving: ServingParams) -> bool:
    return stop(Service("proxy", Path(serving.home).resolve()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--host", default=None, help="listen address (default serving.proxy.host, loopback)")
    parser.add_argument("--foreground", action="store_true", help="exec the proxy in this process (containers)")


def main(args: argparse.Namespace, params: Params) -> int:
    serving = params.serving
    if args.action == "up" and args.foreground:
        os.environ.update(_env(serving))
        cmd = _command(serving, args.host or serving.proxy.host)
        os.execv(cmd[0], cmd)  # noqa: S606 - replaces this process with the proxy (fixed argv)
    if args.action == "up":
        key = serving.proxy.key_file if not os.environ.get(KEY_ENV) else "$" + KEY_ENV
        print(f"proxy: {up(serving, args.host)}/v1  key file {key}")
    elif args.action == "down":
        print(f"proxy: {'stopped' if down(serving) else 'not running'}")
    elif not http_ok(base_url(serving) + "/health/liveliness"):
        print(f"proxy: down at {base_url(serving)}")
    elif serving.proxy.host in ("127.0.0.1", "localhost") and Service("proxy", Path(serving.home).resolve()).pid() is None:
        print(f"proxy: down; {base_url(serving)} answers, but from a proxy this checkout did not start (`up` refuses it)")
    else:
        print(f"proxy: up at {base_url(serving)}")
    return 0
