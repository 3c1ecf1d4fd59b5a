"""Mirror rollout traces into MLflow Tracing, so each rollout opens as a span tree in the MLflow UI.

The JSONL shard files stay the source of truth (DVC outs, read by the dataset builders); this is a
view. Spans are replayed after the rollout with their recorded latencies, as children of one
``rollout`` root span.
"""

from __future__ import annotations

import json
import time
from typing import Any

import mlflow

SPAN_TYPES = {"llm": "CHAT_MODEL", "tool": "TOOL", "reward": "EVALUATOR", "decision": "AGENT"}


def log_traces(traces: list[dict[str, Any]]) -> list[str]:
    """Log each rollout as an MLflow trace; returns their trace ids in order."""
    logged: list[str] = []
    for t in traces:
        start = time.time_ns() - int(t.get("latency_s", 0) * 1e9)
        root = mlflow.start_span_no_context(
            name=f"rollout {t['rollout_id']}", span_type="AGENT", start_time_ns=start,
            inputs={"task_id": t["task_id"], "rollout_id": t["rollout_id"], "label": t.get("label")},
            attributes={"shard": str(t["shard"]), "status": t["status"], "routing_version": str(t.get("routing_version"))},
            tags={"pipeline.run_id": t["run_id"], "status": t["status"]})
        clock = start
        for s in t.get("spans", []):
            data = s["data"]
            duration = int(float(data.get("latency_s", 0.0)) * 1e9)
            child = mlflow.start_span_no_context(
                name=f"{s['kind']}:{s['name']}", span_type=SPAN_TYPES.get(s["kind"], "UNKNOWN"), parent_span=root,
                start_time_ns=clock, inputs=data.get("messages") or data.get("args") or data.get("candidates"),
                attributes={k: json.dumps(v, default=str)[:2000] for k, v in data.items()
                            if k not in ("messages", "output", "result")})
            child.set_outputs(data.get("output") or data.get("result")
                              or {k: data.get(k) for k in ("value", "chosen", "propensity") if k in data})
            clock += duration
            child.end(end_time_ns=clock)
        root.set_outputs({"decision": t.get("decision"), "rationale": t.get("rationale"), "protocol": t.get("protocol"),
                          "reward": t.get("reward"), "error": t.get("error")})
        root.end(end_time_ns=max(clock, start + 1))
        logged.append(root.trace_id)
    return logged
