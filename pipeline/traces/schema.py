"""One JSON line per rollout with ordered spans (see docs/agents.md for the field list).

Span kinds: ``llm`` (role, logical and served model, messages, output, usage, latency), ``tool``
(name, args, result, ok/error, latency, sender), ``reward`` (value, kind, reason), ``decision``
(candidates, chosen, propensity). Kept as plain dicts in state so LangGraph can merge them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, FiniteFloat

SpanKind = Literal["llm", "tool", "reward", "decision"]


class Span(BaseModel):
    kind: SpanKind
    name: str
    seq: int = 0
    data: dict[str, Any] = Field(default_factory=dict)


class Trace(BaseModel):
    run_id: str
    shard: int
    task_id: str
    rollout_id: str
    status: Literal["ok", "failed"]
    error: str | None = None
    routing_version: int | str | None = None  # a live version number, or ``eval:<name>`` for an evaluation table
    label: str | None = None
    decision: str | None = None
    rationale: str | None = None
    protocol: dict[str, Any] | None = None
    reward: FiniteFloat | None = None  # NaN (a hand edit, a broken judge) sorts unpredictably, inf above every reward
    rewards: dict[str, FiniteFloat] = Field(default_factory=dict)
    turns: int = 0
    tokens: int = 0
    latency_s: float = 0.0
    attempts: int = 1
    spans: list[Span] = Field(default_factory=list)

    def final(self) -> dict[str, Any]:
        """What a scored rollout earned: its ``final`` reward span's value, components and reason (judged, or a failed
        rollout's failure score with its decision credit, ``agents.rollout.failed_span``). The one reading of a
        society's reward: evaluation's scorer and the test report's records."""
        found = next((s.data for s in self.spans if s.kind == "reward" and s.name == "final"), None)
        if found is None:
            raise ValueError(f"rollout {self.rollout_id}: no final reward span (it was run unscored)")
        return found
