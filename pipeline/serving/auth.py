"""LiteLLM proxy hook: the proxy's key check, answering 401 with a clear message.

Loaded inside the proxy process (``general_settings.custom_auth``). LiteLLM's own check without a
database answered a request without a key with HTTP 500 and a wrong key with 400 "No connected db.";
a client (and a monitor) expects 401 and a reason. The key is compared in constant time with the
proxy's ``LITELLM_MASTER_KEY``; nothing about the expected key is ever echoed.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from litellm.proxy._types import LitellmUserRoles, ProxyException, UserAPIKeyAuth

from pipeline.serving.proxy import KEY_ENV


def _refuse(message: str) -> ProxyException:
    return ProxyException(message=message, type="auth_error", param="Authorization", code=401,
                          headers={"WWW-Authenticate": 'Bearer realm="pubmedqa-proxy"'})


async def user_api_key_auth(request: Any, api_key: str | None) -> UserAPIKeyAuth:
    expected = os.environ.get(KEY_ENV, "")
    presented = (api_key or "").strip().removeprefix("Bearer ").strip()
    if not expected:
        raise _refuse("the proxy has no key configured (LITELLM_MASTER_KEY); it refuses every request")
    if not presented:
        raise _refuse("missing API key: send 'Authorization: Bearer <key>' "
                      "(the key is in serving.proxy.key_file or $LITELLM_MASTER_KEY)")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise _refuse("invalid API key")
    return UserAPIKeyAuth(api_key=presented, user_role=LitellmUserRoles.PROXY_ADMIN)
