"""LoRA adapters through S3, for vLLM workers that do not share a filesystem with the promotion task.

Promotion publishes a version's adapter folder under the worker's ``adapter_store``
(``s3://models/adapters/<worker>/<adapter>/``, a ``_COMPLETE`` marker written last); a sidecar next to
each vLLM replica (``python -m pipeline serve sync-adapters``, infra/k8s/vllm-deployment.yaml) copies
complete adapters into the worker's ``adapter_dir``; promotion then hot-loads ``<adapter_dir>/<adapter>``
and retries while the sidecar has not copied it yet. Every replica syncs the same store, and vLLM's
filesystem resolver (``VLLM_LORA_RESOLVER_CACHE_DIR`` = ``adapter_dir``) loads an adapter there on a
replica's first request for it, so replicas the load request did not reach, or started later, serve it
too (``--lora-modules`` not needed). Downloads land in a temp folder
renamed into place: a worker never sees half an adapter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.config import S3ClientParams
from pipeline.io import UnsafePathError, inside
from pipeline.serving.names import NAME

MARKER = "_COMPLETE"
# An adapter's name is one path segment the engine can be asked for: letters, digits, '.', '_', '-',
# not starting with '.' (so never '.' or '..'). Keys naming anything else are never synced.
ADAPTER_NAME = NAME


def check_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise UnsafePathError(f"{name!r}: not a valid adapter name (pattern {ADAPTER_NAME.pattern})")
    return name


def _split(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{uri}: an adapter store must be an s3://bucket/prefix URI")
    return parsed.netloc, parsed.path.strip("/")


def _client(s3: S3ClientParams):  # type: ignore[no-untyped-def]
    import boto3  # noqa: PLC0415 - only S3 adapter stores need it (0.2 s); the CPU model plane has no boto3

    return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL"), config=s3.botocore())


def publish(folder: str | Path, store: str, name: str, client: S3ClientParams) -> str:
    """Upload ``folder`` as adapter ``name`` under ``store``; the marker goes last. Returns its URI."""
    bucket, prefix = _split(store)
    s3 = _client(client)
    base = f"{prefix}/{check_name(name)}".strip("/")
    files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]
    if not any(p.name == "adapter_config.json" for p in files):
        raise FileNotFoundError(f"{folder}: not a PEFT adapter folder (no adapter_config.json)")
    for path in files:
        s3.upload_file(str(path), bucket, f"{base}/{path.relative_to(folder).as_posix()}")
    s3.put_object(Bucket=bucket, Key=f"{base}/{MARKER}", Body=b"")
    return f"s3://{bucket}/{base}"


def complete(s3: Any, bucket: str, prefix: str) -> list[str]:
    """Adapter names under ``s3://bucket/prefix`` whose upload finished (``s3``: a boto3 client)."""
    names = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):].strip("/") if prefix else obj["Key"]
            name, _, rest = rel.partition("/")
            if rest == MARKER and ADAPTER_NAME.fullmatch(name):
                names.add(name)
            elif rest == MARKER:
                print(f"adapter store: ignoring s3://{bucket}/{obj['Key']}: {name!r} is not a valid adapter name", flush=True)
    return sorted(names)


def sync(store: str, dest: str | Path, client: S3ClientParams) -> list[str]:
    """Copy every complete adapter of ``store`` not yet in ``dest``; returns the names copied."""
    bucket, prefix = _split(store)
    s3 = _client(client)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in complete(s3, bucket, prefix):
        final = inside(dest, check_name(name))
        if (final / "adapter_config.json").exists():
            continue
        tmp = Path(tempfile.mkdtemp(dir=dest, prefix=f".{name}-"))
        try:
            base = f"{prefix}/{name}".strip("/")
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{base}/"):
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(base) + 1:]
                    if rel == MARKER:
                        continue
                    target = inside(tmp, rel)  # a hostile key ('../x', 'a//b', '/abs') fails the whole adapter
                    target.parent.mkdir(parents=True, exist_ok=True)
                    s3.download_file(bucket, obj["Key"], str(target))
            tmp.chmod(0o755)
            shutil.rmtree(final, ignore_errors=True)  # a leftover without adapter_config.json
            tmp.rename(final)
            copied.append(name)
        except UnsafePathError as exc:
            print(f"adapter store: not syncing {name!r} from s3://{bucket}/{base}/: {exc}", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return copied


def sync_forever(store: str, dest: str | Path, every_s: float, client: S3ClientParams) -> None:
    """The sidecar's loop: a failed pass (S3 briefly away) is reported and retried, never fatal."""
    while True:
        try:
            for name in sync(store, dest, client):
                print(f"sync-adapters: {name} -> {Path(dest) / name}", flush=True)
        except Exception as exc:
            print(f"sync-adapters: pass failed, retrying in {every_s:.0f}s: {exc}", flush=True)
        time.sleep(every_s)
