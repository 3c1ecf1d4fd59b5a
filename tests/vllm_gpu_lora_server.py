"""Serve the GPU image's own vLLM (0.20.2) HTTP app, as each GPU worker would build it, with no engine behind it
(run by tests/test_vllm_gpu_lora_routes.py).

Run with the model venv's python and the unpacked release first on PYTHONPATH (.venv/gpu-unpacked,
requirements/gpu-unpacked.txt). Reads one line, {"deployments": [{"name", "launcher", "argv", "env"}]} on stdin
(``launcher``: ``api_server`` for the local workers' ``python -m vllm.entrypoints.openai.api_server``, ``serve``
for the stock image's ``vllm serve`` entrypoint). For each deployment, under its own environment (the runtime-LoRA
switch decides whether vLLM registers the load/unload routes at all), it parses the argv with that release's
parser, builds the app with that release's ``build_app`` (routers, vLLM's own key check, the ``--middleware``
guard) and puts that release's ``OpenAIServingModels`` behind it, as ``init_app_state`` does, static
``--lora-modules`` included. The workers' key is this process's ``VLLM_API_KEY``. Then it serves every app on a
free loopback port, prints {name: port} and serves until stdin closes.

What stands in is the GPU engine alone (no CUDA here): its health check answers, and its ``add_lora`` takes the
``LoRARequest`` vLLM built or refuses a folder without ``adapter_config.json`` as the real engine's loader does, which
is the answer a worker gives while its sidecar has yet to copy a published adapter. Everything a client's request
meets before the engine (route, key check, guard, request model, vLLM's bookkeeping of loaded adapters, what
/v1/models lists) is the release's own code.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import uvicorn
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.utils import process_lora_modules

from tests.vllm_gpu_parse import parsers  # the release's parsers (importing it puts the CPU platform in for defaults)

ROOT = Path(__file__).resolve().parent.parent


class Engine:
    """The GPU engine's part of a LoRA load: take vLLM's request, or refuse a folder that holds no adapter."""

    def __init__(self, model: str, max_model_len: int) -> None:
        self.model_config = SimpleNamespace(model=model, max_model_len=max_model_len)  # the resolver matches on model
        self.renderer = self.input_processor = None

    async def check_health(self) -> None:  # /health asks the engine (and answers 200 when it returns)
        return None

    async def add_lora(self, request: Any) -> bool:
        if not Path(request.lora_path, "adapter_config.json").exists():  # noqa: ASYNC240 - one stat, as the engine's loader
            raise ValueError(f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}")
        return True


def build(deployment: dict[str, Any], parser: Any) -> Any:
    """The app this deployment's worker serves, built under its own environment (the key, ``VLLM_API_KEY``, is this
    process's: the guard reads it when the app first answers)."""
    saved = dict(os.environ)
    os.environ.update(deployment["env"])
    try:
        args = parser.parse_args(deployment["argv"])
        validate_parsed_serve_args(args)
        app = build_app(args, supported_tasks=("generate",))
        names = args.served_model_name or [args.model]
        engine = Engine(args.model, args.max_model_len or 4096)
        models = OpenAIServingModels(engine,
                                     [BaseModelPath(name=n, model_path=args.model) for n in names],
                                     lora_modules=process_lora_modules(args.lora_modules, {}))
        asyncio.run(models.init_static_loras())
        app.state.openai_serving_models, app.state.engine_client = models, engine
        return app
    finally:
        os.environ.clear()
        os.environ.update(saved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    request = json.loads(sys.stdin.readline())  # one line: the rest of stdin is the test's hold on this process
    # the stock images import the guard from a folder holding vllm_guard.py alone (compose's volume, Kubernetes'
    # init container): the same here
    guard = Path(tempfile.mkdtemp(prefix="vllm-guard-"))
    shutil.copy(ROOT / "pipeline/serving/vllm_guard.py", guard / "vllm_guard.py")
    sys.path.insert(0, str(guard))
    ps = parsers()
    servers, ports = [], {}
    for d in request["deployments"]:
        app = build(d, ps[d["launcher"]])
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        ports[d["name"]] = port
    deadline = time.monotonic() + 60
    while not all(s.started for s in servers):
        if time.monotonic() > deadline:
            raise SystemExit("the apps did not start within 60 s")
        time.sleep(0.05)
    print(json.dumps(ports), flush=True)
    sys.stdin.read()  # until the test closes stdin
    for s in servers:
        s.should_exit = True
    shutil.rmtree(guard, ignore_errors=True)


if __name__ == "__main__":
    main()
