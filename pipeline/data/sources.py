"""Fetch raw bytes from a local path, an http(s) URL or an s3:// URI.

S3 goes through boto3 and honours the usual AWS_* variables, including ``AWS_ENDPOINT_URL`` for
MinIO or any S3-compatible server; credentials never live in params.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path


class SourceError(RuntimeError):
    pass


def read_bytes(uri: str, timeout_s: float = 60.0) -> bytes:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri, timeout=timeout_s) as resp:  # noqa: S310 - user-given data URL
                return resp.read()
        except OSError as exc:
            raise SourceError(f"{uri}: download failed: {exc}") from exc
    if parsed.scheme == "s3":
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            obj = boto3.client("s3").get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
            return obj["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise SourceError(f"{uri}: S3 read failed: {exc}") from exc
    if parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.exists():
            raise SourceError(f"{path}: file not found")
        return path.read_bytes()
    raise SourceError(f"{uri}: unsupported scheme '{parsed.scheme}' (use a path, http(s)://, s3:// or hf://)")
