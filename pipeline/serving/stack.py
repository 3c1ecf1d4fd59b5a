"""Bring the whole local serving plane up (workers, proxy, routing) or down in one call.

Used by ``make run`` before the stages that call models, and by integration tests. Remote
workers (production GPU hosts) are only health-checked, never started from here.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from pipeline import promotion
from pipeline.config import Params
from pipeline.serving import proxy, routing, worker


def ensure(params: Params) -> tuple[str, str]:
    """Workers + proxy running and a verified routing version live; returns (base_url, key).

    Mapped Airflow tasks call this at the same time: a file lock lets one start the services
    while the others wait and then find them healthy.
    """
    home = Path(params.serving.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "stack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for w in params.serving.workers:
            worker.up(params, w)
        proxy.up(params)
        live = routing.active(params)
        if live is None or routing.verify(params, live):
            routing.apply(params, live["version"] if live else routing.versions(params)[-1])
    if promotion.pending(params):  # a switch a crash interrupted: alias and routing must agree before anything is served
        from pipeline import tracking

        tracking.setup(params)
        promotion.reconcile(params)
    return proxy.client_settings(params)


def down(params: Params) -> None:
    proxy.down(params)
    for w in params.serving.workers:
        worker.down(params, w)
