"""``agl-server`` (Agent Lightning 1.0.2's gateway + store) with the upstream's key: ``python -m pipeline.rl.agl_server``.

The gateway forwards every agent call to the registered policy server with only a ``content-type`` header
(``agentlightning/server/proxy.py``, ``_send_upstream_with_retries``, on the ``httpx.AsyncClient`` its app's lifespan
opens). A local vLLM worker requires its key, so this entry point is Agent Lightning's own (same Hydra config
``pkg://agentlightning.config/server``, same ``create_app``, same uvicorn settings) with one change: when
``AGL_UPSTREAM_KEY`` is set, that client sends ``Authorization: Bearer <key>`` on every upstream request. The key
comes from the environment only (never argv, never the Hydra config, which agl-server logs).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import hydra
import uvicorn
from agentlightning.server.app import create_app
from omegaconf import DictConfig

from pipeline.rl.gateway import UPSTREAM_KEY_ENV


def with_upstream_key(app: Any, key: str) -> Any:
    """Wrap the app's lifespan: after Agent Lightning opens its upstream client, give it the key as a default header
    (httpx merges it under each request's own headers)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            a.state.http_client.headers["Authorization"] = f"Bearer {key}"
            yield state

    app.router.lifespan_context = lifespan
    return app


def build(config: DictConfig | None) -> Any:
    app = create_app(config)
    key = os.environ.get(UPSTREAM_KEY_ENV)
    return with_upstream_key(app, key) if key else app


@hydra.main(version_base=None, config_path="pkg://agentlightning.config", config_name="server")
def main(config: DictConfig) -> None:
    uvicorn.run(build(config), host=str(config.host), port=int(config.port), workers=1, timeout_keep_alive=120)


if __name__ == "__main__":
    main()
