"""Start, probe and stop detached service processes by name.

A service belongs to the checkout whose home holds its pid file, and it is reused only when it runs
with the identity it would be started with now (``claim``): the backend store for MLflow, the model
folder and served name for a worker, the config for the proxy. Anything else answering on the port
is an error naming the port, what answers there and the param to change, never a silent reuse:
two clones on one machine must not log into, register into or route through each other's services.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# the caller's MLflow login stays with the caller: a service that needs one is given it by name (``env``)
CALLER_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
OWNER_ENV = "PIPELINE_SERVICE_OWNER"  # set on a service at start: its orphans are recognised by it, never by name


class ServiceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Service:
    name: str
    home: Path
    home_mode: int = 0o700  # logs, databases and caches: its owner's only (0o711 where another user must traverse it)

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
        """The recorded process, if it still runs and is the one that was started (not a reused pid)."""
        try:
            pid = int(self.pid_file.read_text().strip())
            written = self.pid_file.stat().st_mtime
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        started = _process_start(pid)
        if started is not None and started > written + 5:
            return None  # the pid was reused by a later, unrelated process
        return pid

    def runs_as(self, identity: Mapping[str, object], secrets: Mapping[str, str] | None = None) -> bool:
        """Our recorded process is alive and was started with this identity and, when given, these secrets in its
        environment (a key rotated since: restart it, or every client holding the new key is refused)."""
        pid = self.pid()
        return (pid is not None and self.meta().get("identity") == identity_key(identity)
                and _started_with(pid, secrets or {}))

    def meta(self) -> dict:
        try:
            return json.loads(self.meta_file.read_text())
        except FileNotFoundError:
            return {}


def _process_start(pid: int) -> float | None:
    """Start time (epoch seconds) of a process, from /proc; None where /proc is not available."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _started_with(pid: int, secrets: Mapping[str, str]) -> bool:
    """Whether process ``pid`` was started with these environment values. They are compared in place (the process's
    initial environment, ``/proc/<pid>/environ``, readable by its own user), never recorded. Where that cannot be read
    (no /proc), True: the identity alone decides, as it did before secrets were compared."""
    if not secrets:
        return True
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return True
    env = dict(entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return all(env.get(name.encode()) == value.encode() for name, value in secrets.items())


def identity_key(identity: Mapping[str, object]) -> str:
    return json.dumps(identity, sort_keys=True, default=str)


def claim(service: Service, identity: Mapping[str, object], host: str, port: int, health_url: str, param: str,
          describe: Callable[[], str] | None = None, wait_s: float = 60.0,
          secrets: Mapping[str, str] | None = None, or_else: str = "") -> bool:
    """True if this checkout's own service, with this identity, already answers (reuse it).

    Our own service with another identity (params changed), started with other ``secrets`` (a rotated
    key: compared in its environment, never recorded) or unhealthy is stopped, so the caller
    starts a fresh one. If anything else holds the port, raise naming the port, what answers there
    and the param to change (``or_else``: what else the user may do instead).
    """
    if service.runs_as(identity, secrets):
        deadline = time.monotonic() + wait_s  # ours and the same: it may still be starting (a parallel task)
        while True:
            if http_ok(health_url):
                return True
            if time.monotonic() > deadline or service.pid() is None:
                break
            time.sleep(0.5)
    stop(service)
    if not port_is_free(host, port):
        what = (describe or (lambda: probe_http(f"http://{host}:{port}")))()
        raise ServiceError(f"port {port} on {host} is held by {what}, which this checkout did not start "
                           f"(its {service.name} would run from {service.home}); refusing to use another project's service. "
                           f"Stop it or set {param} to a free port{or_else}.")
    return False


def probe_http(base: str, paths: Sequence[str] = ("/health", "/")) -> str:
    """A short description of what answers at ``base`` (for error messages)."""
    for path in paths:
        req = urllib.request.Request(base + path)  # noqa: S310 - http(s) service URLs built by the project
        try:
            with urllib.request.urlopen(req, timeout=2.0) as resp:  # noqa: S310 - loopback probe
                server = resp.headers.get("server", "")
                return f"an HTTP server (GET {path} -> {resp.status}{', server ' + server if server else ''})"
        except urllib.error.HTTPError as exc:
            return f"an HTTP server (GET {path} -> {exc.code})"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            continue
    return "a process that does not answer HTTP"


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


_HANDED_OUT: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and client sockets (Linux's default where /proc cannot say)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a service started later, chosen outside the ephemeral range.

    A port from ``bind(0)`` is in the kernel's ephemeral range, so between the choice and the start
    any client socket or any other ``bind(0)`` (vLLM's torch.distributed rendezvous, a ZMQ socket)
    may take it; a CI run lost a worker's port that way after 30 minutes. Ports below (or above) the
    range are handed out only on request, and never twice by this process.
    """
    low, high = ephemeral_range()
    pool = range(10000, low) if low > 12000 else range(high + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(pool)
        if port not in _HANDED_OUT and port_is_free(host, port):  # a listener there, on it or 0.0.0.0, fails the bind
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # crowded: the kernel's choice
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> bool:
    req = urllib.request.Request(url, headers=dict(headers or {}))  # noqa: S310 - http(s) health URLs built by the project
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback health probe
            return 200 <= resp.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start(
    service: Service,
    cmd: Sequence[str],
    health_url: str | Callable[[], bool],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    meta: Mapping[str, object] | None = None,
    cwd: str | Path | None = None,
    health_headers: Mapping[str, str] | None = None,
    identity: Mapping[str, object] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> int:
    """Start ``cmd`` detached unless this same service (same identity) already answers; wait until healthy.

    ``health_url`` is an HTTP URL that answers 2xx when the service is ready, or a callable for services
    that do not speak HTTP (Postgres, Redis, a Celery worker).
    """
    service.home.mkdir(parents=True, exist_ok=True)
    service.home.chmod(service.home_mode)
    identity = identity or {"cmd": list(cmd)}
    ready: Callable[[], bool] = ((lambda: http_ok(health_url, headers=health_headers)) if isinstance(health_url, str)
                                 else health_url)
    if service.runs_as(identity, secrets) and ready():
        return service.pid()  # type: ignore[return-value]
    stop(service)
    owner = f"{service.home.resolve()}/{service.name}:{uuid.uuid4().hex}"  # inherited by every process the service starts
    log = os.fdopen(os.open(service.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
    service.log_file.chmod(0o600)  # a log from before this rule
    proc = subprocess.Popen(
        list(cmd),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if k not in CALLER_CREDENTIALS}, **(env or {}), OWNER_ENV: owner},
        cwd=cwd,
        start_new_session=True,
        umask=0o077,  # what the service writes (mlflow.db, its caches, artifacts) is owner-only
    )
    log.close()
    service.pid_file.write_text(str(proc.pid))
    health = health_url if isinstance(health_url, str) else getattr(health_url, "__name__", "check")
    service.meta_file.write_text(json.dumps({"cmd": list(cmd), "health_url": health, "identity": identity_key(identity),
                                             "pgid": proc.pid, "owner": owner, **(meta or {})}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = service.log_file.read_text(errors="replace")[-3000:]
            service.pid_file.unlink(missing_ok=True)
            raise ServiceError(f"{service.name} exited with {proc.returncode}; log {service.log_file}:\n{tail}")
        if ready():
            return proc.pid
        time.sleep(0.5)
    stop(service)
    raise ServiceError(f"{service.name} not healthy ({health}) after {timeout_s:.0f}s; log {service.log_file}")


def stop(service: Service, grace_s: float = 15.0) -> bool:
    """SIGTERM the service's process group, then SIGKILL what is left; True if something ran. A group whose leader died
    (a SIGKILLed worker leaves its engine process behind) is found by the group recorded at start and stopped only
    when a member still carries this start's owner mark in its environment: never by name, never a reused group."""
    pid = service.pid()
    service.pid_file.unlink(missing_ok=True)
    meta = service.meta()
    pgid: int | None = None
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            pgid = os.getpgid(pid)
    elif meta.get("pgid") and meta.get("owner") and _owned(int(meta["pgid"]), str(meta["owner"])):
        pgid = int(meta["pgid"])
    if pgid is None:
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            if pid is not None:
                _reap(pid)  # the leader may have become a zombie only now
            return True
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if pid is not None:
        _reap(pid)
    return True


def _members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of group ``pgid``, from /proc."""
    out = []
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _owned(pgid: int, owner: str) -> bool:
    """Whether a live member of group ``pgid`` was started by this service's start (its environment holds the mark)."""
    mark = f"{OWNER_ENV}={owner}".encode()
    for member in _members(pgid):
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{member}/environ").read_bytes().split(b"\0"):
                return True
    return False


def _reap(pid: int) -> None:
    """Collect the exit status of a service this process started (else it lingers as a zombie)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: a service started by a long-lived
    process (a test session, the Airflow task that brought the serving plane up) stays a zombie until
    that process reaps it, and waiting for it to vanish would always take the whole grace period."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        entries = []
    if not entries:  # no /proc: ask the kernel (zombies count there)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in entries:
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            return True
    return False
