"""Service processes started in-process (a test session, an Airflow task) stop cleanly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from pipeline.services.process import Service, _group_alive, ephemeral_range, free_port, port_is_free, start, stop


def test_stop_reaps_what_this_process_started_and_the_group_is_gone(tmp_path: Path) -> None:
    svc = Service("sleeper", tmp_path)
    pid = start(svc, ["bash", "-c", "sleep 300 & sleep 300"], lambda: True, timeout_s=5)
    pgid = os.getpgid(pid)
    assert _group_alive(pgid)
    assert stop(svc, grace_s=30)
    assert not _group_alive(pgid)
    with pytest.raises(ChildProcessError):  # already reaped by stop(): no zombie left behind
        os.waitpid(pid, os.WNOHANG)
    assert svc.pid() is None and not stop(svc)


def test_a_port_promised_to_a_later_service_is_not_taken_by_port_zero_binds() -> None:
    """A CI run lost a worker's port: chosen at session start, it was taken 30 minutes later by a socket the kernel
    gave port 0 (vLLM's torch.distributed rendezvous, a client). Promised ports sit outside the ephemeral range."""
    low, high = ephemeral_range()
    promised = [free_port() for _ in range(20)]
    assert len(set(promised)) == 20  # never handed out twice
    assert all(not low <= p <= high for p in promised)
    held = []
    try:
        for _ in range(200):  # what the kernel gives everything else meanwhile
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        assert not {s.getsockname()[1] for s in held} & set(promised)
        assert all(port_is_free("127.0.0.1", p) for p in promised)
    finally:
        for sock in held:
            sock.close()


def test_what_a_service_writes_is_its_owners_only(tmp_path: Path) -> None:
    """Logs, databases and caches (mlflow.db, a worker's compile cache) are written 0600 in a 0700 home (#44)."""
    home = tmp_path / "svc"
    svc = Service("writer", home)
    start(svc, ["bash", "-c", "echo hello; touch state.db; mkdir cache; sleep 300"], lambda: (home / "state.db").exists(),
          timeout_s=10, cwd=home)
    try:
        modes = {p.name: p.stat().st_mode & 0o777 for p in (home, svc.log_file, home / "state.db", home / "cache")}
        assert modes == {"svc": 0o700, "writer.log": 0o600, "state.db": 0o600, "cache": 0o700}
    finally:
        stop(svc)


def test_a_home_another_user_must_traverse_keeps_its_mode_through_start(tmp_path: Path) -> None:
    """The prod stack as root gives its home 0711 so that the `postgres` user reaches its data folder: `start` of any
    of its services must not take that back (it did, and Postgres could not open its data folder)."""
    home = tmp_path / "stack"
    home.mkdir(mode=0o711)
    svc = Service("traversed", home, home_mode=0o711)
    start(svc, ["bash", "-c", "touch ready; sleep 300"], lambda: (home / "ready").exists(), timeout_s=10, cwd=home)
    try:
        assert home.stat().st_mode & 0o777 == 0o711 and svc.log_file.stat().st_mode & 0o777 == 0o600
    finally:
        stop(svc)


def test_what_a_killed_service_left_running_is_stopped_by_its_group_and_mark(tmp_path: Path) -> None:
    """A SIGKILLed vLLM worker leaves its engine process running (#44): `stop` (and so `up`, which stops first, and
    `services down`) finds it by the recorded process group and the owner mark in its environment, not by name."""
    import signal
    import subprocess
    import time

    svc = Service("leader", tmp_path)
    ready = tmp_path / "forked"  # the leader is killed only once its child exists (a fast kill raced the fork)
    pid = start(svc, ["bash", "-c", f"sleep 300 & touch {ready}; wait"], ready.exists, timeout_s=10)
    pgid = os.getpgid(pid)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # another group: never touched
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(0.2)
    assert _group_alive(pgid) and svc.pid() is None  # the orphan runs on without its leader
    assert stop(svc, grace_s=10)
    assert not _group_alive(pgid) and stranger.poll() is None
    stranger.kill()
    stranger.wait()
    assert not stop(svc)  # nothing left, nothing else touched


def _supervised(tmp_path: Path, restarts: int,
                script: str = "sleep 300 &\necho $! > {tmp}/.engine-child.pid && mv {tmp}/.engine-child.pid {tmp}/engine-child.pid\nwait\n",
                min_uptime_s: float = 0.0) -> tuple[Service, int, Path]:
    """An engine that leaves a child behind when killed (as vLLM's API server leaves its EngineCore), supervised."""
    import sys

    engine = tmp_path / "engine.sh"
    engine.write_text("#!/bin/bash\n" + script.format(tmp=tmp_path))
    engine.chmod(0o755)
    child_pid = tmp_path / "engine.pid"
    svc = Service("supervised", tmp_path / "home")
    cmd = [sys.executable, "-m", "pipeline.services.supervise", "--restarts", str(restarts), "--backoff-s", "0.2",
           "--cap-s", "0.4", "--window-s", "60", "--min-uptime-s", str(min_uptime_s), "--child-pid-file", str(child_pid),
           "--", str(engine)]
    started = tmp_path / "engine-child.pid"
    # both pid files: the engine's child can write its own before the supervisor, descheduled on a busy host, has
    # written the engine's (a suite run read engine.pid before it existed)
    pid = start(svc, cmd, lambda: started.exists() and child_pid.exists(), timeout_s=20,
                env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return svc, pid, child_pid


def _wait_for(check, timeout_s: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_a_killed_engine_is_restarted_with_backoff_and_what_it_left_is_killed(tmp_path: Path) -> None:
    """The supervisor restarts a SIGKILLed engine by itself (#44) and first kills the orphan the dead engine left in
    the group; after ``restarts`` deaths within the window it gives up; a group stop ends everything."""
    import signal

    svc, leader, engine_file = _supervised(tmp_path, restarts=2)
    try:
        for death in (1, 2):
            engine = int(engine_file.read_text())
            orphan = int((tmp_path / "engine-child.pid").read_text())
            os.kill(engine, signal.SIGKILL)
            assert _wait_for(lambda e=engine: engine_file.exists() and int(engine_file.read_text()) != e)  # restarted
            assert _wait_for(lambda o=orphan: not _alive(o)), f"death {death}: the dead engine's child still runs"
            assert svc.pid() == leader  # the service itself never went down
        engine = int(engine_file.read_text())
        assert _wait_for(lambda: int((tmp_path / "engine-child.pid").read_text()) != orphan)
        os.kill(engine, signal.SIGKILL)  # a third death within the window: the supervisor gives up
        assert _wait_for(lambda: svc.pid() is None or not _alive(leader))
        assert "giving up" in svc.log_file.read_text()
        assert not _group_alive(leader)
    finally:
        stop(svc, grace_s=5)


def test_a_supervised_engine_stops_with_its_group_and_is_not_restarted(tmp_path: Path) -> None:
    svc, leader, engine_file = _supervised(tmp_path, restarts=5)
    engine = int(engine_file.read_text())
    assert stop(svc, grace_s=10)
    assert not _group_alive(leader) and not _alive(engine) and "restart" not in svc.log_file.read_text()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_an_engine_that_fails_to_start_is_reported_not_restarted(tmp_path: Path) -> None:
    """A death within min_uptime_s of the start is a failed start (a bad model, a taken port): the supervisor exits with
    the engine's status and `start` reports it with the log's tail, instead of retrying a broken configuration."""
    from pipeline.services.process import ServiceError

    with pytest.raises(ServiceError, match=r"exited with 3(.|\n)*no such model(.|\n)*a failed start, not restarted"):
        _supervised(tmp_path, restarts=5, script="echo no such model >&2\nexit 3\n", min_uptime_s=30)


def test_an_engine_whose_supervisor_is_killed_stops_instead_of_serving_unsupervised(tmp_path: Path) -> None:
    """#56: SIGKILL the supervisor and the engine kept serving, with no one to restart it, until the next `services up`.
    The engine gets SIGTERM when its supervisor dies (its parent-death signal), so nothing serves unsupervised."""
    import signal

    svc, leader, engine_file = _supervised(tmp_path, restarts=5)
    try:
        engine = int(engine_file.read_text())
        os.kill(leader, signal.SIGKILL)
        assert _wait_for(lambda: not _alive(engine), timeout_s=10), "the engine outlived its supervisor"
    finally:
        stop(svc, grace_s=5)
