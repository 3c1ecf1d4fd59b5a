"""Keep one local engine alive: restart it with bounded exponential backoff when it dies, never leave its children.

The supervisor leads the service's process group and runs the engine inside it. When the engine exits (a crash, an
OOM kill, a SIGKILL), everything else left in the group (vLLM's ``EngineCore``) is killed before the next start, so a
restart never meets the old engine's port or memory. A SIGTERM to the group (``services down``) stops it for good;
a supervisor killed outright takes its engine with it (the engine's parent-death signal).
Standard library only: it runs in whichever environment the engine does (the model plane for vLLM).

    python -m pipeline.services.supervise --restarts 5 --backoff-s 2 --cap-s 30 --window-s 600 --min-uptime-s 60 \
        --child-pid-file PATH -- ENGINE ARGV...
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.io import write_text


def _others_in_group(pgid: int) -> list[int]:
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def _kill_leftovers(pgid: int) -> int:
    """SIGKILL what the dead engine left in this group; returns how many there were."""
    left = _others_in_group(pgid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _others_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(left)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int) -> None:
    """In the engine, before exec: SIGTERM it when the supervisor dies. A SIGKILLed supervisor must not leave an engine
    serving with no one to restart it or to stop its group; the proxy then answers 503 until `services up`."""
    import ctypes  # noqa: PLC0415 - only in the forked child

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the supervisor died before the prctl took effect
        os._exit(1)


def delays(restarts: int, backoff_s: float, cap_s: float) -> list[float]:
    """The waits before restart 1..n: doubling from ``backoff_s``, capped."""
    return [min(cap_s, backoff_s * 2**i) for i in range(restarts)]


def supervise(cmd: list[str], restarts: int, backoff_s: float, cap_s: float, window_s: float,
              child_pid_file: Path | None = None, min_uptime_s: float = 0.0) -> int:
    """Run ``cmd`` until told to stop; restart it after a death, at most ``restarts`` times within ``window_s``. An engine
    that dies within ``min_uptime_s`` of its start failed to start (a bad model, a taken port): that is reported, with
    its exit status, to whoever started the service, not retried (supervisord's ``startsecs``)."""
    stopping = False
    child: subprocess.Popen | None = None

    def on_term(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    pgid = os.getpgid(0)
    die_with_me = functools.partial(_die_with, os.getpid())
    deaths: list[float] = []
    waits = delays(restarts, backoff_s, cap_s)
    while not stopping:
        # same group: a group stop reaches the engine and its children; the engine dies with its supervisor
        child = subprocess.Popen(cmd, preexec_fn=die_with_me)  # noqa: PLW1509 - prctl needs the child, before exec
        started = time.monotonic()
        if child_pid_file is not None:
            write_text(child_pid_file, str(child.pid))  # whole or not at all: readers poll it while it changes
        rc = child.wait()
        if stopping:
            break
        killed = _kill_leftovers(pgid)
        now = time.monotonic()
        if now - started < min_uptime_s:
            print(f"supervise: engine exited with {rc} {now - started:.0f}s after its start (< {min_uptime_s:g}s): "
                  "a failed start, not restarted", file=sys.stderr, flush=True)
            return rc or 1
        deaths = [t for t in deaths if now - t < window_s] + [now]
        if len(deaths) > restarts:
            print(f"supervise: engine exited with {rc}, {len(deaths)} deaths in {window_s:.0f}s; giving up",
                  file=sys.stderr, flush=True)
            return rc or 1
        wait = waits[len(deaths) - 1]
        print(f"supervise: engine exited with {rc} ({killed} leftover processes killed); restart "
              f"{len(deaths)}/{restarts} in {wait:g}s", file=sys.stderr, flush=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not stopping:
            time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.services.supervise", description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, required=True)
    parser.add_argument("--backoff-s", type=float, required=True)
    parser.add_argument("--cap-s", type=float, required=True)
    parser.add_argument("--window-s", type=float, required=True)
    parser.add_argument("--min-uptime-s", type=float, default=0.0)
    parser.add_argument("--child-pid-file", type=Path)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("the engine's argv follows --")
    return supervise(cmd, args.restarts, args.backoff_s, args.cap_s, args.window_s, args.child_pid_file, args.min_uptime_s)


if __name__ == "__main__":
    raise SystemExit(main())
