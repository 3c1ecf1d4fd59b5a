"""The sha256 that ties a registered version to what serves it (``sha256`` tag; routing ``digests``; span ``digest``).

A file's digest is its bytes'. A folder's is the sha256 of its sorted ``<relative path>\\0<file sha256>\\n``
lines, so renaming, adding, removing or changing any file changes it. One field is left out:
``adapter_config.json``'s ``base_model_name_or_path``, which says where the *serving engine's* base
model lives and is rewritten at deploy for each worker (vLLM's filesystem resolver matches it against
``--model``); everything that decides what the adapter computes (rank, alpha, target modules, weights)
stays covered.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

SHA256_TAG = "sha256"  # the model-version tag holding its artifact's digest (set at registration)
ADAPTER_CONFIG = "adapter_config.json"
DEPLOY_FIELD = "base_model_name_or_path"


def file_hash(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in 1 MiB blocks (model files run to gigabytes)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    if path.name == ADAPTER_CONFIG:
        cfg = json.loads(path.read_text())
        cfg.pop(DEPLOY_FIELD, None)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    return file_hash(path)


def artifact_sha256(path: str | Path) -> str:
    """sha256 of a file, or of a folder's files (see the module docstring)."""
    path = Path(path)
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder to digest")
    lines = [f"{p.relative_to(path).as_posix()}\0{_file_sha256(p)}\n" for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


SHORT = 12  # hex digits of the digest in a served adapter's name: enough to tell versions apart, short for logs
_SERVED = re.compile(rf"^(?:[^/]+/)?(?P<role>[A-Za-z0-9_.]+)-v(?P<version>\d+)-(?P<sha>[0-9a-f]{{{SHORT}}})$")


def served_name(role: str, version: str | int, sha256: str) -> str:
    """The name a worker serves a LoRA version under: ``<role>-v<N>-<sha256[:12]>``."""
    return f"{role}-v{version}-{sha256[:SHORT]}"


def served_digest(deployment: str | None) -> str | None:
    """The digest prefix a deployment name carries (``<worker>/<role>-v<N>-<sha12>``), None for a base model."""
    m = _SERVED.match(deployment or "")
    return m.group("sha") if m else None
