"""Generated service keys kept in owner-only files: the proxy's master key and the local workers' key.

A key from the environment always wins (production: a Secret); otherwise the file is created once with
mode 0600 and read back. A file others can read is refused, so a key never sits where another user sees it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pipeline.services.process import ServiceError


def read_or_create(path: str | Path, prefix: str = "sk-") -> str:
    """The key in ``path``, generating it (0600, in a 0700 folder) when the file does not exist yet."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # written whole beside it, then linked into place (link never replaces): a process that starts beside this one
        # (the proxy and the workers start side by side) reads the whole key or creates none, never an empty file
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{prefix}{secrets.token_urlsafe(32)}\n")
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process linked its key first: read theirs
            pass
        finally:
            tmp.unlink()
    if path.stat().st_mode & 0o077:
        raise ServiceError(f"{path}: key file must be readable by its owner only (chmod 600)")
    key = path.read_text().strip()
    if not key:
        raise ServiceError(f"{path}: empty key file (delete it to have a new key generated)")
    return key
