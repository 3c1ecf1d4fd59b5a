"""Bucket bootstrap for the S3 side of a deployment (MLflow artifacts, the DVC remote, model adapters).

boto3 against whatever ``AWS_ENDPOINT_URL`` (or ``endpoint_url``) names: MinIO in docker-compose and on
Kubernetes, moto's S3 server in ``make prod-stack``, AWS S3 itself when unset. Idempotent, so every
deploy step may run it. ``python -m pipeline prod buckets`` runs it with ``prod_stack.buckets``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import boto3
from botocore.exceptions import ClientError

from pipeline.config import S3ClientParams


def ensure(names: Iterable[str], client: S3ClientParams, endpoint_url: str | None = None, region: str | None = None,
           access_key: str | None = None, secret_key: str | None = None) -> list[str]:
    """Create the buckets that do not exist yet; return the ones created (an empty list on a rerun).
    Keys not given come from boto3's usual chain (env, profile, instance role)."""
    region = region or os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"), region_name=region,
                      aws_access_key_id=access_key, aws_secret_access_key=secret_key, config=client.botocore())
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    created = []
    for name in names:
        if name in existing:
            continue
        kwargs = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            s3.create_bucket(Bucket=name, **kwargs)
        except ClientError as exc:  # created meanwhile by a parallel bootstrap: fine; someone else's name: an error
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise
            continue
        created.append(name)
    return created
