"""The sha256 that ties a registered version to what serves it (``sha256`` tag; routing ``digests``; span ``digest``).

A file's digest is its bytes'. A folder's is the sha256 of its sorted ``<relative path>\\0<file sha256>\\n``
lines, so renaming, adding, removing or changing any file changes it. One field is left out:
``adapter_config.json``'s ``base_model_name_or_path``, which says where the *serving engine's* base
model lives and is rewritten at deploy for each worker (vLLM's filesystem resolver matches it against
``--model``); everything that decides what the adapter computes (rank, alpha, target modules, weights)
stays covered.
"""

from __future__ import annotations

from pipeline.serving.vllm_guard import (  # the worker verifies with the same code (it receives that file alone)
    ADAPTER_CONFIG,
    DEPLOY_FIELD,
    DIGITS,
    SERVED,
    artifact_sha256,
    file_hash,
)

__all__ = [
    "ADAPTER_CONFIG",
    "DEPLOY_FIELD",
    "DIGITS",
    "SHA256_TAG",
    "artifact_sha256",
    "file_hash",
    "served_digest",
    "served_name",
]

SHA256_TAG = "sha256"  # the model-version tag holding its artifact's digest (set at registration)


def served_name(role: str, version: str | int, sha256: str) -> str:
    """The name a worker serves a LoRA version under: ``<role>-v<N>-<sha256>``."""
    return f"{role}-v{version}-{sha256[:DIGITS]}"


def served_digest(deployment: str | None) -> str | None:
    """The digest prefix a deployment name carries (``<worker>/<role>-v<N>-<sha256>``, 12 digits in older
    names), None for a base model."""
    m = SERVED.match(deployment or "")
    return m.group("sha") if m else None
