"""Atomic file writes: a failed or killed step never leaves a half-written output behind.

Everything is written to a temp file in the destination directory (same filesystem, so the final
``os.replace`` is atomic) and fsync'ed before the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(dest: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside ``dest``; rename it onto ``dest`` only if the block succeeds."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix or ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(dest: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    with atomic_path(dest) as tmp:
        kwargs: dict[str, Any] = {} if "b" in mode else {"encoding": encoding}
        with open(tmp, mode, **kwargs) as fh:
            yield fh


def write_json(dest: str | Path, obj: Any) -> None:
    with atomic_open(dest) as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, default=str)
        fh.write("\n")


def write_text(dest: str | Path, text: str) -> None:
    with atomic_open(dest) as fh:
        fh.write(text)



@contextlib.contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Build a directory beside ``dest`` and swap it in whole, so readers never see a mix."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the swapped-in output should read like any folder
    old = dest.with_name(f".{dest.name}.old")
    try:
        yield tmp
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_rows(path: str | Path, minimum: int, noun: str, why: str, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """A JSONL training file's rows; a missing or too-small file, or a row that is not a JSON object with the
    ``required`` keys, raises one line naming the file, the line and the rule."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no {noun}s; run the datasets stage first")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: byte {exc.start}: not UTF-8 ({exc.reason})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: each {noun} row must be one JSON object ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: each {noun} row must be one JSON object (found a {type(row).__name__})")
        if missing := [k for k in required if k not in row]:
            raise ValueError(f"{path}:{i}: each {noun} row needs {', '.join(required)} (missing: {', '.join(missing)})")
        rows.append(row)
    if len(rows) < minimum:
        raise ValueError(f"{path}: {len(rows)} {noun} row(s); {why}")
    return rows


class UnsafePathError(ValueError):
    """A path built from a remote key or a registry value that would leave its folder."""


def inside(base: str | Path, relative: str) -> Path:
    """``base / relative`` when it stays inside ``base``; raises naming the value otherwise.

    Remote keys and registry values are data, not paths: an S3 key ``a/../_COMPLETE`` or ``a//b``, an
    absolute path, or a symlinked parent must never make a download or an rmtree reach outside its folder.
    """
    parts = relative.split("/")
    if (not relative or relative.startswith("/") or any(p in ("", ".", "..") for p in parts)
            or "\\" in relative or "\0" in relative):
        raise UnsafePathError(f"{relative!r}: not a plain relative path (empty, '.', '..' or absolute segment)")
    root = Path(base).resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or target == root:
        raise UnsafePathError(f"{relative!r} resolves to {target}, outside {root}")
    return root / relative
