"""Fetch raw bytes from a local path, an http(s) URL or an s3:// URI, within what the deployment allows.

A DAG run's ``data_source`` Param reaches this code from anyone who can trigger the DAG, so a source is
checked against ``data.allow`` before a byte is read: its scheme, its host (http/https) or bucket (s3),
and for local files the folders they may live in. Every read has a size cap and a total deadline (not
only a per-socket timeout: a server trickling one byte a second never trips that), network reads retry
a bounded number of times, and ``data.source_sha256`` pins the exact bytes. S3 goes through boto3 and
honours the usual AWS_* variables, including ``AWS_ENDPOINT_URL`` for MinIO; credentials never live in
params.
"""

from __future__ import annotations

import hashlib
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import SourceAllowParams

CHUNK = 1 << 16


class SourceError(RuntimeError):
    pass


def check_allowed(uri: str, allow: SourceAllowParams) -> None:
    """Raise naming the rule when ``uri`` is outside what ``data.allow`` permits."""
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme or "file"  # hf://… parses with scheme "hf"
    if scheme not in allow.schemes:
        raise SourceError(f"{uri}: scheme '{scheme}' is not in data.allow.schemes {allow.schemes}")
    if scheme in ("http", "https", "s3") and parsed.hostname not in allow.hosts:
        what = "bucket" if scheme == "s3" else "host"
        raise SourceError(f"{uri}: {what} '{parsed.hostname}' is not in data.allow.hosts {allow.hosts}")
    if scheme == "file":
        path = Path(parsed.path if parsed.scheme == "file" else uri).resolve()
        if not any(path.is_relative_to(Path(root).expanduser().resolve()) for root in allow.local_roots):
            raise SourceError(f"{uri}: {path} is outside data.allow.local_roots {allow.local_roots}")


def _bounded(stream: Any, uri: str, max_bytes: int, deadline: float) -> bytes:
    parts, size = [], 0
    while chunk := stream.read(CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise SourceError(f"{uri}: larger than the cap of {max_bytes} bytes (data.allow.max_bytes)")
        if time.monotonic() > deadline:
            raise SourceError(f"{uri}: not read within the deadline (data.allow.deadline_s)")
        parts.append(chunk)
    return b"".join(parts)


def read_bytes(uri: str, timeout_s: float = 60.0, allow: SourceAllowParams | None = None, sha256: str | None = None) -> bytes:
    """The bytes at ``uri``; with ``allow``: only an allowed source, within its size cap and deadline, retried
    up to ``allow.retries`` times on network errors; with ``sha256``: only those exact bytes."""
    if allow is not None:
        check_allowed(uri, allow)
    max_bytes = allow.max_bytes if allow else 1 << 40
    deadline_s = allow.deadline_s if allow else 24 * 3600.0
    attempts = 1 + (allow.retries if allow else 0)
    for attempt in range(attempts):
        try:
            data = _read(uri, timeout_s, max_bytes, time.monotonic() + deadline_s)
            break
        except _Transient as exc:
            if attempt + 1 == attempts:
                raise SourceError(f"{uri}: {exc} (after {attempts} attempt(s))") from exc
            time.sleep(min(2.0**attempt, 10.0))
    if sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != sha256.lower():
        raise SourceError(f"{uri}: sha256 {got} does not match the pinned {sha256} (data.source_sha256)")
    return data


class _Transient(Exception):
    """A network failure worth another attempt."""


def _read(uri: str, timeout_s: float, max_bytes: int, deadline: float) -> bytes:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri, timeout=timeout_s) as resp:  # noqa: S310 - an allowed data URL
                length = resp.headers.get("Content-Length")
                if length and int(length) > max_bytes:
                    raise SourceError(f"{uri}: {length} bytes, over the cap of {max_bytes} bytes (data.allow.max_bytes)")
                return _bounded(resp, uri, max_bytes, deadline)
        except OSError as exc:
            raise _Transient(f"download failed: {exc}") from exc
    if parsed.scheme == "s3":
        import boto3  # noqa: PLC0415 - 0.15 s import, only s3:// sources need it
        from botocore.config import Config  # noqa: PLC0415 - as above
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - as above

        try:
            # one attempt: the loop above retries (allow.retries) within the deadline; botocore's own would multiply them
            one = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1})
            s3 = boto3.client("s3", config=one)
            obj = s3.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
            if obj.get("ContentLength", 0) > max_bytes:
                raise SourceError(f"{uri}: {obj['ContentLength']} bytes, over the cap of {max_bytes} bytes "
                                  "(data.allow.max_bytes)")
            return _bounded(obj["Body"], uri, max_bytes, deadline)
        except ClientError as exc:
            raise SourceError(f"{uri}: S3 read failed: {exc}") from exc
        except BotoCoreError as exc:
            raise _Transient(f"S3 read failed: {exc}") from exc
    if parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.exists():
            raise SourceError(f"{path}: file not found")
        if path.stat().st_size > max_bytes:
            raise SourceError(f"{path}: {path.stat().st_size} bytes, over the cap of {max_bytes} bytes (data.allow.max_bytes)")
        return path.read_bytes()
    raise SourceError(f"{uri}: unsupported scheme '{parsed.scheme}' (use a path, http(s)://, s3:// or hf://)")
