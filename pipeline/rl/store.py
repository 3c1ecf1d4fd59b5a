"""The RL trace store: one JSON file per training rollout under ``ppo.agl.trace_dir`` (a DVC output).

The Agent Lightning gateway keeps rollouts in memory and the trainer deletes them once consumed, so
what is not written here is gone when either process stops. Two writers, one file per rollout id,
each write atomic:

- the agent entry point writes ``{trace, events, reward}`` before it exits (so a rollout whose agent
  exited 0 is on disk whatever happens to the gateway afterwards);
- the trainer's ``RolloutHooks`` (``pipeline/rl/hooks.py``) fills in rollouts the agent could not
  record (killed on timeout, crashed) and never overwrites a complete record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.io import write_json

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
TRACE_DIR_ENV = "PUBMEDQA_RL_TRACE_DIR"  # set by pipeline.rl.gateway (controller, rollouts) and train_ppo (trainer, hooks)
ROLE_ENV = "PUBMEDQA_RL_ROLE"  # the role being trained: train_ppo@<role> sets it for the rollouts it starts
RUN_ENV = "PUBMEDQA_RL_RUN_ID"  # the train_ppo MLflow run a record was collected for


def path(trace_dir: str | Path, rollout_id: str) -> Path:
    return Path(trace_dir) / f"{_SAFE.sub('_', rollout_id)}.json"


def read(trace_dir: str | Path, rollout_id: str) -> dict[str, Any] | None:
    p = path(trace_dir, rollout_id)
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write(trace_dir: str | Path, record: dict[str, Any]) -> Path:
    p = path(trace_dir, record["rollout_id"])
    write_json(p, record)
    return p


def records(trace_dir: str | Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(trace_dir).glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    return out


def triplets(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training transitions in a rollout's gateway events: model calls with prompt and response token ids."""
    out = []
    for e in events:
        if e.get("event_type") != "model_request":
            continue
        resp = (e.get("data") or {}).get("response") or {}
        choices = resp.get("choices") or [{}]
        prompt_ids = resp.get("prompt_token_ids") or choices[0].get("prompt_token_ids") or []
        response_ids = choices[0].get("token_ids") or []
        if prompt_ids and response_ids and (e["data"].get("http_status") or 200) < 400:
            out.append({"prompt_token_ids": prompt_ids, "response_token_ids": response_ids})
    return out
