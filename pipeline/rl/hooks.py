"""``RolloutHooks`` for the verl trainer (``agentlightning.hooks`` = this file): persist before delete.

Agent Lightning loads the single ``RolloutHooks`` subclass of this file by path and calls it after
each rollout reaches a terminal state, before the trainer deletes the rollout from the gateway.
Keep it the only subclass here (``load_hooks`` refuses two).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from agentlightning.hooks import RolloutHooks

from pipeline.rl import store
from pipeline.rl.store import RUN_ENV, TRACE_DIR_ENV


class TraceStoreHooks(RolloutHooks):
    def __init__(self, trace_dir: str | Path | None = None) -> None:
        self.trace_dir = Path(trace_dir or os.environ.get(TRACE_DIR_ENV, "data/rl_traces"))

    def on_startup(self, store_: Any | None = None) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)

    def on_succeeded(self, rollout: Any, events: dict[str, list[Any]], trace_writer: Any) -> None:
        existing = store.read(self.trace_dir, rollout.rollout_id)
        if existing and existing.get("events"):
            return  # the agent wrote the complete record itself
        flat = [e.model_dump(mode="json") if hasattr(e, "model_dump") else e for attempt in events.values() for e in attempt]
        rewards = [e["data"].get("value") for e in flat if e.get("event_type") == "reward"]
        store.write(self.trace_dir, {**(existing or {}), "rollout_id": rollout.rollout_id, "status": "succeeded",
                                     "run_id": (existing or {}).get("run_id") or os.environ.get(RUN_ENV),
                                     "input": rollout.input, "events": flat, "reward": rewards[-1] if rewards else None,
                                     "written_by": (existing or {}).get("written_by", "hooks"), "persisted_at": time.time()})

    def on_failed(self, rollout: Any, trace_writer: Any) -> None:
        existing = store.read(self.trace_dir, rollout.rollout_id) or {}
        store.write(self.trace_dir, {**existing, "rollout_id": rollout.rollout_id, "status": "failed", "input": rollout.input,
                                     "run_id": existing.get("run_id") or os.environ.get(RUN_ENV),
                                     "error": rollout.status.error_message or existing.get("error") or "failed",
                                     "events": existing.get("events", []), "reward": existing.get("reward"),
                                     "written_by": existing.get("written_by", "hooks"), "persisted_at": time.time()})
