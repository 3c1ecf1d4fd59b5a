"""LiteLLM proxy hook: resolve a role name to its deployment from the active routing version.

Loaded inside the proxy process (``litellm_settings.callbacks``). A request may name an evaluation
routing table in ``metadata.routing`` (``eval/<name>.json`` beside the active file, written by the
``evaluate`` stage): that request is routed by it, everything else by the live version. The active routing file is
re-read when its mtime changes and replaced atomically by ``route apply``, so each request sees one
whole version, and requests already in flight keep the deployment they started with.

A deployment that does not answer (its worker crashed or is restarting) is reported as what it is: 503 with
``Retry-After``, not LiteLLM's 500, so a client retries instead of failing the call (``agents.llm.RoleClient`` does).
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from pipeline.serving.names import EVAL_NAME


class RoleRouter(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self._path = os.environ.get("PIPELINE_ROUTING_ACTIVE", "")
        self._cache: dict[str, tuple[int, dict[str, Any]]] = {}

    def table(self, routing: str | None = None) -> dict[str, Any]:
        """The live table, or the evaluation table a request names (``metadata.routing``)."""
        path = self._path
        if routing:
            if not isinstance(routing, str) or not EVAL_NAME.fullmatch(routing):
                raise _client_error(f"metadata.routing {str(routing)[:80]!r}: not an evaluation routing name", "metadata")
            path = os.path.join(os.path.dirname(self._path), "eval", f"{routing}.json")
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            if routing:  # an evaluation must never fall back to the live routing silently
                raise _client_error(f"evaluation routing {routing!r} does not exist (evaluation tables live only while "
                                    "their evaluation runs)", "metadata") from None
            return self._cache.get(path, (0, {}))[1]
        cached = self._cache.get(path)
        if cached is None or cached[0] != mtime:
            with open(path) as fh:
                cached = (mtime, json.load(fh))
            self._cache[path] = cached
        return cached[1]

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: str) -> dict:
        # the deployment is the routing's choice: a client naming its own upstream (LiteLLM would call it, with whatever
        # key it was given) is refused as the client's mistake it is, before anything leaves the proxy
        if chosen := sorted(k for k in UPSTREAM_KEYS if k in data):
            raise _client_error(f"{', '.join(chosen)}: a client may not choose the upstream; name a role as the model",
                                chosen[0])
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise _client_error("metadata must be an object", "metadata")
        routing = metadata.get("routing")
        table = self.table(routing)
        role = data.get("model")
        roles = table.get("roles", {})
        # every role of the spec is in the table: `route apply` fills a role a version does not name from where it
        # inherits (roles.<r>.inherits), and stack.ensure re-applies when the spec's roles change
        target = roles.get(role)
        if not target:  # a deployment or adapter name (`base/<any folder the engine sees>`) is never served directly
            raise ProxyException(message=f"model {str(role)[:80]!r} is not a role of routing version {table.get('version')}: "
                                         f"this proxy serves the role names {sorted(table.get('roles', {}))} only",
                                 type="invalid_request_error", param="model", code=404)
        data["model"] = target
        metadata = data.setdefault("metadata", {})
        metadata.update({"role": role, "routing_version": table.get("version")})
        return data


    async def async_post_call_failure_hook(self, request_data: dict, original_exception: Exception, user_api_key_dict: Any,
                                           traceback_str: str | None = None) -> HTTPException | None:
        if not _unreachable(original_exception):
            return None
        role = (request_data.get("metadata") or {}).get("role") or request_data.get("model")
        return HTTPException(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
                             detail={"error": f"the deployment serving {str(role)[:80]!r} is not answering (its worker is "
                                              f"down or restarting); retry after {RETRY_AFTER_S} s"})


UPSTREAM_KEYS = ("api_base", "base_url", "api_key", "api_version", "custom_llm_provider", "litellm_params")


def _client_error(message: str, param: str) -> ProxyException:
    return ProxyException(message=message, type="invalid_request_error", param=param, code=400)


RETRY_AFTER_S = 5
_DOWN = ("Cannot connect to host", "Connection refused", "ConnectError", "Server disconnected", "RemoteProtocolError")


def _unreachable(exc: BaseException | None) -> bool:
    """A backend that is down, not one that answered with an error: a connection that failed, anywhere in the chain."""
    seen = 0
    while exc is not None and seen < 8:
        if any(m in f"{type(exc).__name__}: {exc}" for m in _DOWN):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


role_router = RoleRouter()
