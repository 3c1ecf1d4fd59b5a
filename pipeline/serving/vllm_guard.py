"""ASGI middleware for the vLLM worker (``--middleware pipeline.serving.vllm_guard.KeyOnEveryPath``): the key on
every path but ``/health``, and only adapters whose bytes match the digest their name carries.

vLLM's own ``--api-key`` check (vllm 0.32, ``entrypoints/serve/middleware/authenticate.py``) guards only paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere``: ``/invocations`` (SageMaker), ``/tokenize``, ``/pooling`` and the
rest generate or run the model without a key. This one requires ``Authorization: Bearer $VLLM_API_KEY`` everywhere
except the health check supervisors poll. It runs inside the vLLM server process (imported by path, so stdlib only)
and reads the key the worker was started with; with no key it refuses to start rather than pass requests open.

**Digest at every load.** A served LoRA is named ``<role>-v<N>-<sha256>`` (``pipeline.digest.served_name``). Before
vLLM may load one (``/v1/load_lora_adapter``, or a completion naming it, which vLLM's filesystem resolver loads from
``VLLM_LORA_RESOLVER_CACHE_DIR/<name>`` after a restart), the folder's digest is computed here and compared with the
name's; a mismatch is refused (409) and logged with both digests. Digests are cached by the files' size and mtime, so a
request costs a few ``stat`` calls. The folder digest itself lives in this file, because this file is what a worker
image receives (alone); ``pipeline.digest`` uses it from here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)
ADAPTER_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
LOADS = ("/v1/load_lora_adapter", "/v1/chat/completions", "/v1/completions")
ADAPTER_CONFIG = "adapter_config.json"
DEPLOY_FIELD = "base_model_name_or_path"
DIGITS = 64  # the whole sha256 in a served adapter's name: a prefix would be a second preimage away from a forgery
LEGACY = 12  # names deployed before: still verified, on the 48 bits they carry
SERVED = re.compile(rf"^(?:[^/]+/)?(?P<role>[A-Za-z0-9_.]+)-v(?P<version>\d+)-"
                    rf"(?P<sha>[0-9a-f]{{{DIGITS}}}|[0-9a-f]{{{LEGACY}}})$")


def file_hash(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in 1 MiB blocks (model files run to gigabytes)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    if path.name == ADAPTER_CONFIG:  # where the engine keeps its base model is rewritten per worker: not covered
        cfg = json.loads(path.read_text())
        cfg.pop(DEPLOY_FIELD, None)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    return file_hash(path)


def artifact_sha256(path: str | Path) -> str:
    """sha256 of a file, or of a folder: the sha256 of its sorted ``<relative path>\\0<file sha256>\\n`` lines."""
    path = Path(path)
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder to digest")
    lines = [f"{p.relative_to(path).as_posix()}\0{_file_sha256(p)}\n" for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


_verified: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}


def folder_digest(folder: Path) -> str:
    """The folder's digest, recomputed only when a file's size or mtime changed since the last time."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    signature = tuple((p.as_posix(), (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
    cached = _verified.get(str(folder))
    if cached is not None and cached[0] == signature:
        return cached[1]
    digest = artifact_sha256(folder)
    _verified[str(folder)] = (signature, digest)
    return digest


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why this request must not load the adapter it names (None: it names none, or one whose bytes match its name)."""
    if path == "/v1/load_lora_adapter":
        name, folder = str(body.get("lora_name") or ""), Path(str(body.get("lora_path") or ""))
    else:
        name = str(body.get("model") or "")
        folder = Path(os.environ.get(ADAPTER_DIR_ENV, "/nonexistent")) / name
    served = SERVED.match(name)
    if served is None or not (folder / ADAPTER_CONFIG).exists():
        return None  # a base model, an unversioned name, or nothing on disk for the resolver: vLLM decides
    got = folder_digest(folder)
    if got[:len(served.group("sha"))] != served.group("sha"):
        return (f"adapter {name}: the folder {folder} has sha256 {got}, but its name says {served.group('sha')}: "
                "refusing to load weights that are not the registered ones")
    return None


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
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            if scope["type"] == "http" and scope.get("method") == "POST" and path in LOADS:
                await self._checked(path, scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _reply(send, 401, f"Unauthorized: send 'Authorization: Bearer <{KEY_ENV}>'", [(b"www-authenticate", b"Bearer")])

    async def _checked(self, path: str, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        """Read the request body, refuse a load of tampered adapter bytes, else hand the body on unchanged."""
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # a disconnect: let the app see it
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw or b"{}")
            why = refusal(path, body) if isinstance(body, dict) else None
        except (ValueError, OSError):
            why = None  # not JSON, or nothing readable on disk: vLLM answers it as it would
        if why is not None:
            print(f"vllm_guard: {why}", file=sys.stderr, flush=True)
            await _reply(send, 409, why)
            return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send: Callable[[Any], Awaitable[None]], status: int, message: str,
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
