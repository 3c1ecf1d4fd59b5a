"""Bring the whole local serving plane up (workers, proxy, routing) or down in one call.

Used by ``make run`` before the stages that call models, and by integration tests. Remote
workers (production GPU hosts) are only health-checked, never started from here.
"""

from __future__ import annotations

import fcntl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline import promotion, timing, tracking
from pipeline.config import MlflowParams, ServingParams
from pipeline.serving import proxy, routing, worker


def ensure(serving: ServingParams, mlflow: MlflowParams) -> tuple[str, str]:
    """Workers + proxy running and a verified routing version live; returns (base_url, key).

    Mapped Airflow tasks call this at the same time: a file lock lets one start the services
    while the others wait and then find them healthy. ``mlflow``: where a routed policy and a
    switch a crash interrupted are resolved. A registry whose champions disagree with the promotion journal is
    refused (``promotion.PromotionError``).
    """
    with timing.phase(timing.Phase.SERVING):
        return _ensure(serving, mlflow)


def _ensure(serving: ServingParams, mlflow: MlflowParams) -> tuple[str, str]:
    home = Path(serving.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "stack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # the proxy needs no worker to start: its boot (~7 s of imports here) overlaps the workers'
        with ThreadPoolExecutor(max_workers=1) as pool:
            proxy_up = pool.submit(proxy.up, serving)
            for w in serving.workers:
                worker.up(serving, w)
            proxy_up.result()
        live = routing.active(serving)
        # a role added to or removed from the spec since the live table was applied: the same version, re-read (a role
        # it does not name routed where it inherits from), verified and applied again
        if live is None or set(live["roles"]) != set(serving.roles) or routing.verify(serving, mlflow, live):
            routing.apply(serving, mlflow, live["version"] if live else routing.versions(serving)[-1])
    if promotion.pending(serving):  # a switch a crash interrupted: alias and routing must agree before anything is served
        tracking.setup(mlflow)
        promotion.reconcile(serving, mlflow)
    # what is served follows the journal, not a registry someone else wrote (#44); once a routing version was written
    # (a promotion, a `route new`) a missing journal is checked too: a trained champion must have its switch there
    if promotion.journal(serving) or any(routing.generated_dir(serving).glob("v*.yaml")):
        tracking.setup(mlflow)
        live = routing.active(serving) or {}
        promotion.check(serving, [*serving.roles, *(live.get("policies") or {})])
    return proxy.client_settings(serving)


def down(serving: ServingParams) -> None:
    proxy.down(serving)
    for w in serving.workers:
        worker.down(serving, w)
