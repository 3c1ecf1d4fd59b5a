"""Start, probe and stop detached service processes by name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class ServiceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Service:
    name: str
    home: Path

    @property
    def pid_file(self) -> Path:
        return self.home / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.home / f"{self.name}.log"

    @property
    def meta_file(self) -> Path:
        return self.home / f"{self.name}.json"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid

    def meta(self) -> dict:
        try:
            return json.loads(self.meta_file.read_text())
        except FileNotFoundError:
            return {}


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> bool:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback health probe
            return 200 <= resp.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start(
    service: Service,
    cmd: Sequence[str],
    health_url: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    meta: Mapping[str, object] | None = None,
    cwd: str | Path | None = None,
    health_headers: Mapping[str, str] | None = None,
) -> int:
    """Start ``cmd`` detached unless it already answers ``health_url``; wait until it does."""
    service.home.mkdir(parents=True, exist_ok=True)
    if service.pid() and http_ok(health_url, headers=health_headers):
        return service.pid()  # type: ignore[return-value]
    stop(service)
    log = open(service.log_file, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(  # noqa: S603 - fixed argv built by the project
        list(cmd),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    log.close()
    service.pid_file.write_text(str(proc.pid))
    service.meta_file.write_text(json.dumps({"cmd": list(cmd), "health_url": health_url, **(meta or {})}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = service.log_file.read_text(errors="replace")[-3000:]
            service.pid_file.unlink(missing_ok=True)
            raise ServiceError(f"{service.name} exited with {proc.returncode}; log {service.log_file}:\n{tail}")
        if http_ok(health_url, headers=health_headers):
            return proc.pid
        time.sleep(0.5)
    stop(service)
    raise ServiceError(f"{service.name} not healthy at {health_url} after {timeout_s:.0f}s; log {service.log_file}")


def stop(service: Service, grace_s: float = 15.0) -> bool:
    """SIGTERM the service's process group, then SIGKILL what is left; True if something ran."""
    pid = service.pid()
    service.pid_file.unlink(missing_ok=True)
    if pid is None:
        return False
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True
