"""Bring the whole local serving plane up (workers, proxy, routing) or down in one call.

Used by ``make run`` before the stages that call models, and by integration tests. Remote
workers (production GPU hosts) are only health-checked, never started from here.
"""

from __future__ import annotations

from pipeline.config import Params
from pipeline.serving import proxy, routing, worker


def ensure(params: Params) -> tuple[str, str]:
    """Workers + proxy running and a verified routing version live; returns (base_url, key)."""
    for w in params.serving.workers:
        worker.up(params, w)
    proxy.up(params)
    live = routing.active(params)
    if live is None or routing.verify(params, live):
        routing.apply(params, live["version"] if live else routing.versions(params)[-1])
    return proxy.client_settings(params)


def down(params: Params) -> None:
    proxy.down(params)
    for w in params.serving.workers:
        worker.down(params, w)
