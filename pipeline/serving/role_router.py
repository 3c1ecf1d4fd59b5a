"""LiteLLM proxy hook: resolve a role name to its deployment from the active routing version.

Loaded inside the proxy process (``litellm_settings.callbacks``). The active routing file is
re-read when its mtime changes and replaced atomically by ``route apply``, so each request sees one
whole version, and requests already in flight keep the deployment they started with.
"""

from __future__ import annotations

import json
import os
from typing import Any

from litellm.integrations.custom_logger import CustomLogger


class RoleRouter(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self._path = os.environ.get("PIPELINE_ROUTING_ACTIVE", "")
        self._mtime = -1.0
        self._table: dict[str, Any] = {}

    def table(self) -> dict[str, Any]:
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except OSError:
            return self._table
        if mtime != self._mtime:
            with open(self._path) as fh:
                self._table = json.load(fh)
            self._mtime = mtime
        return self._table

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: str) -> dict:
        table = self.table()
        role = data.get("model")
        target = table.get("roles", {}).get(role)
        if target:
            data["model"] = target
            metadata = data.setdefault("metadata", {})
            metadata.update({"role": role, "routing_version": table.get("version")})
        return data


role_router = RoleRouter()
