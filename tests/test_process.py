"""Service processes started in-process (a test session, an Airflow task) stop cleanly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.services.process import Service, _group_alive, start, stop


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
