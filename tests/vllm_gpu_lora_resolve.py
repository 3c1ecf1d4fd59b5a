"""Resolve adapters as a restarted GPU worker does, with the GPU image's own vLLM (0.20.2) (run by
tests/test_vllm_gpu_lora_routes.py).

Run with the model venv's python and the unpacked release first on PYTHONPATH. Reads {"model": the worker's
``--model``, "names": [adapter, ...]} on stdin; ``VLLM_LORA_RESOLVER_CACHE_DIR`` is in this process's environment,
as in the worker's. A restarted worker has none of its hot-loaded adapters in memory: a request naming one is
resolved by the filesystem resolver that the release's general plugins register (its ``vllm.general_plugins``
entry point) from that folder. So this loads the release's plugins, puts them behind the release's
``OpenAIServingModels`` and asks it to resolve each name, as a chat request for an unknown model does. The engine
stands in as in tests/vllm_gpu_lora_server.py (its own class). Prints {"resolvers": [...], "names": {name: "loaded" or the
error}, "models": what /v1/models would list}.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.lora.resolver import LoRAResolverRegistry
from vllm.plugins import load_general_plugins

from tests.vllm_gpu_lora_server import Engine  # the same engine stand-in (and, through it, the CPU platform)


async def resolve(model: str, names: list[str]) -> dict[str, Any]:
    load_general_plugins()
    models = OpenAIServingModels(Engine(model, 4096), [BaseModelPath(name="served", model_path=model)])
    out: dict[str, str] = {}
    for name in names:
        got = await models.resolve_lora(name)
        out[name] = "loaded" if hasattr(got, "lora_path") else got.error.message  # type: ignore[union-attr]
    listed = await models.show_available_models()
    return {"resolvers": list(LoRAResolverRegistry.get_supported_resolvers()), "names": out,
            "models": [m.id for m in listed.data]}


def main() -> None:
    request = json.load(sys.stdin)
    print(json.dumps(asyncio.run(resolve(request["model"], request["names"]))))


if __name__ == "__main__":
    main()
