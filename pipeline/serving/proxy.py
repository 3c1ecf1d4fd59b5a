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
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import Params
from pipeline.envs import REPO_ROOT
from pipeline.io import write_text
from pipeline.services.process import Service, ServiceError, claim, http_ok, start, stop
from pipeline.serving.worker import KEY_ENV as WORKER_KEY_ENV
from pipeline.serving.worker import served_name

KEY_ENV = "LITELLM_MASTER_KEY"


def api_key(params: Params) -> str:
    """The proxy key: from the environment, else the local key file (created 0600 on first use)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    path = Path(params.serving.proxy.key_file)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"sk-{secrets.token_urlsafe(32)}\n")
    if path.stat().st_mode & 0o077:
        raise ServiceError(f"{path}: proxy key file must be readable by its owner only (chmod 600)")
    return path.read_text().strip()


def base_url(params: Params) -> str:
    return f"http://{params.serving.proxy.host}:{params.serving.proxy.port}"


def client_settings(params: Params) -> tuple[str, str]:
    """(OpenAI base URL, key) for agents: all they need to reach every role."""
    return f"{base_url(params)}/v1", api_key(params)


def deployments(params: Params) -> dict[str, dict[str, Any]]:
    """Deployment name -> litellm_params, for every worker in params (running or not)."""
    out: dict[str, dict[str, Any]] = {}
    for worker in params.serving.workers:
        api_base = f"http://{worker.host}:{worker.port}/v1"
        # workers that require a key (production: VLLM_API_KEY) get it from the proxy's environment only
        api_key = f"os.environ/{WORKER_KEY_ENV}" if os.environ.get(WORKER_KEY_ENV) else "none"
        common = {"api_base": api_base, "api_key": api_key, "timeout": params.serving.proxy.request_timeout_s}
        out[worker.name] = {"model": f"hosted_vllm/{served_name(worker)}", **common}
        out[f"{worker.name}/*"] = {"model": "hosted_vllm/*", **common}
    return out


def active_file(params: Params) -> Path:
    return Path(params.serving.home).resolve() / "routing" / "active.json"


def write_config(params: Params) -> Path:
    config = {
        "model_list": [{"model_name": name, "litellm_params": lp} for name, lp in deployments(params).items()],
        "litellm_settings": {"callbacks": "pipeline.serving.role_router.role_router", "drop_params": False,
                             "request_timeout": params.serving.proxy.request_timeout_s},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY", "custom_auth": "pipeline.serving.auth.user_api_key_auth"},
    }
    path = Path(params.serving.home).resolve() / "litellm.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, yaml.safe_dump(config, sort_keys=False))
    return path


def _env(params: Params) -> dict[str, str]:
    return {KEY_ENV: api_key(params), "PIPELINE_ROUTING_ACTIVE": str(active_file(params)),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "LITELLM_LOG": os.environ.get("LITELLM_LOG", "ERROR"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _command(params: Params, host: str) -> list[str]:
    litellm = str(Path(sys.executable).with_name("litellm"))
    return [litellm, "--config", str(write_config(params)), "--host", host, "--port", str(params.serving.proxy.port), "--num_workers", "1"]


def up(params: Params, host: str | None = None) -> str:
    """Start the proxy unless it answers; a proxy on another host (compose, Kubernetes) is only health-checked."""
    url = base_url(params)
    health = f"{url}/health/liveliness"
    if params.serving.proxy.host not in ("127.0.0.1", "localhost"):
        if http_ok(health):
            return url
        raise ServiceError(f"proxy at {url} is remote and not healthy; it is not started from here")
    service = Service("proxy", Path(params.serving.home).resolve())
    identity = {"config": str(Path(params.serving.home).resolve() / "litellm.yaml")}
    if claim(service, identity, params.serving.proxy.host, params.serving.proxy.port, health, "serving.proxy.port"):
        return url
    start(service, _command(params, host or params.serving.proxy.host), health, env=_env(params), timeout_s=180, meta={"url": url},
          identity=identity)
    return url


def down(params: Params) -> bool:
    return stop(Service("proxy", Path(params.serving.home).resolve()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--host", default=None, help="listen address (default serving.proxy.host, loopback)")
    parser.add_argument("--foreground", action="store_true", help="exec the proxy in this process (containers)")


def main(args: argparse.Namespace, params: Params) -> int:
    if args.action == "up" and args.foreground:
        os.environ.update(_env(params))
        cmd = _command(params, args.host or params.serving.proxy.host)
        os.execv(cmd[0], cmd)  # noqa: S606 - replaces this process with the proxy (fixed argv)
    if args.action == "up":
        print(f"proxy: {up(params, args.host)}/v1  key file {params.serving.proxy.key_file if not os.environ.get(KEY_ENV) else '$' + KEY_ENV}")
    elif args.action == "down":
        print(f"proxy: {'stopped' if down(params) else 'not running'}")
    else:
        print(f"proxy: {'up' if http_ok(base_url(params) + '/health/liveliness') else 'down'} at {base_url(params)}")
    return 0
