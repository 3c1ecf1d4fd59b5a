"""ASGI middleware for the vLLM worker (``--middleware pipeline.serving.vllm_guard.KeyOnEveryPath``): the key on
every path but ``/health``.

vLLM's own ``--api-key`` check (vllm 0.32, ``entrypoints/serve/middleware/authenticate.py``) guards only paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere``: ``/invocations`` (SageMaker), ``/tokenize``, ``/pooling`` and the
rest generate or run the model without a key. This one requires ``Authorization: Bearer $VLLM_API_KEY`` everywhere
except the health check supervisors poll. It runs inside the vLLM server process (imported by path, so stdlib only)
and reads the key the worker was started with; with no key it refuses to start rather than pass requests open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)


class KeyOnEveryPath:
    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{__name__}: {KEY_ENV} is not set; the worker must not start without a key")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": f"Unauthorized: send 'Authorization: Bearer <{KEY_ENV}>'"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
