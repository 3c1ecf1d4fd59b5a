"""Paths built from remote keys stay inside their folder: hostile S3 keys against a real S3 API (moto's server)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from pipeline.config import S3ClientParams
from pipeline.io import UnsafePathError, inside

CLIENT = S3ClientParams(connect_timeout_s=5, read_timeout_s=5, attempts=2)


@pytest.mark.parametrize("key", ["../x", "a/../../x", "a//b", "/etc/passwd", "a/./b", "", "a\\..\\b", ".."])
def test_inside_refuses_keys_that_leave_or_blur_the_folder(tmp_path: Path, key: str) -> None:
    with pytest.raises(UnsafePathError):
        inside(tmp_path, key)


def test_inside_refuses_a_symlinked_escape(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "link").symlink_to(tmp_path / "out")
    with pytest.raises(UnsafePathError, match="outside"):
        inside(tmp_path / "box", "link/file")
    assert inside(tmp_path / "box", "a/b.json") == (tmp_path / "box").resolve() / "a/b.json"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import boto3
    from moto.server import ThreadedMotoServer

    from pipeline.services.process import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket="models")
    try:
        yield client
    finally:
        server.stop()


def test_sidecar_never_leaves_its_adapter_dir_on_hostile_keys(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pipeline.serving import adapter_store

    dest = tmp_path / "synced" / "adapters"
    dest.mkdir(parents=True)
    canary = tmp_path / "synced" / "keep.txt"
    canary.write_text("outside the adapter dir")
    prefix = f"adapters/{uuid.uuid4().hex}"  # moto keeps its buckets per process: another test's adapters stay out of it
    store = f"s3://models/{prefix}"
    put = lambda key, body=b"{}": s3.put_object(Bucket="models", Key=f"{prefix}/{key}", Body=body)  # noqa: E731
    # the attack of issue 26: a marker "inside" an adapter that rmtree's the parent, and a file key that writes outside
    put("../_COMPLETE", b"")  # adapter name '..': the old sidecar rmtree'd <adapter_dir>/.. (the canary's folder)
    put("evil/../_COMPLETE", b"")
    put("evil/adapter_config.json")
    put("sneaky/adapter_config.json")
    put("sneaky/../../keep.txt", b"overwritten")
    put("sneaky//x.bin", b"x")
    put("sneaky/_COMPLETE", b"")
    put("good/adapter_config.json")
    put("good/weights.safetensors", b"w")
    put("good/_COMPLETE", b"")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="models")["Contents"]]
    assert f"{prefix}/../_COMPLETE" in keys  # the S3 API keeps the hostile key as written
    assert adapter_store.sync(store, dest, CLIENT) == ["good"]
    assert sorted(p.name for p in dest.iterdir()) == ["good"]  # no half adapter, no temp folder left behind
    assert canary.read_text() == "outside the adapter dir"
    assert (dest / "good" / "weights.safetensors").read_bytes() == b"w"
    with pytest.raises(UnsafePathError):
        adapter_store.publish(dest / "good", store, "../escape", CLIENT)


def test_materialize_s3_source_refuses_keys_outside_its_prefix_folder(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pipeline.stages.materialize_model import _download_s3

    prefix = uuid.uuid4().hex
    s3.put_object(Bucket="models", Key=f"{prefix}/config.json", Body=b"{}")
    s3.put_object(Bucket="models", Key=f"{prefix}/../../../escape.txt", Body=b"x")
    with pytest.raises(UnsafePathError):
        _download_s3(f"s3://models/{prefix}", tmp_path / "dl", CLIENT)
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path.parent / "escape.txt").exists()


def test_a_silent_s3_endpoint_fails_after_the_configured_attempts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An adapter store that accepts connections and never answers: the sidecar's pass ends in a read timeout after
    ``attempts`` requests, not botocore's defaults (60 s reads, retried 4 more times)."""
    import socket
    import threading

    from botocore.exceptions import ReadTimeoutError

    from pipeline.serving import adapter_store

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    try:
        with pytest.raises(ReadTimeoutError):
            adapter_store.sync("s3://models/adapters", tmp_path, S3ClientParams(connect_timeout_s=1, read_timeout_s=0.5, attempts=2))
        assert len(accepted) == 2  # one connection a request: the first and one retry
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
