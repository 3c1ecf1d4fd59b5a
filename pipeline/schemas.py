"""Structured outputs of the society and the judge, as pydantic models.

The same classes give the JSON schema sent as ``response_format`` (vLLM guided decoding through
the proxy) and validate what comes back. Fields are few and short on purpose: a 135M model must be
able to fill them within the token budget.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def response_format(cls) -> dict[str, Any]:
        """OpenAI ``response_format`` for this schema (strict JSON schema)."""
        return {"type": "json_schema", "json_schema": {"name": cls.__name__, "schema": cls.model_json_schema(), "strict": True}}


class Hypothesis(_Out):
    hypothesis: str = Field(max_length=600)
    rationale: str = Field(max_length=600)
    evidence_pmids: list[str] = Field(default_factory=list, max_length=5)


class SupervisorChoice(_Out):
    chosen: int = Field(ge=0, le=2, description="index of the selected junior hypothesis")
    reason: str = Field(max_length=400)


class Protocol(_Out):
    title: str = Field(max_length=200)
    objective: str = Field(max_length=500)
    methods: list[str] = Field(min_length=1, max_length=6)
    controls: list[str] = Field(default_factory=list, max_length=4)
    outcome_measures: list[str] = Field(min_length=1, max_length=4)


class Review(_Out):
    severity: Literal["CRITICAL", "MAJOR", "MINOR", "APPROVE"]
    issues: list[str] = Field(default_factory=list, max_length=4)
    summary: str = Field(max_length=400)


class PIDecision(_Out):
    decision: Literal["GO", "NO-GO"]
    rationale: str = Field(max_length=600)


class JudgeScores(_Out):
    novelty: float = Field(ge=0.0, le=1.0)
    feasibility: float = Field(ge=0.0, le=1.0)
    impact: float = Field(ge=0.0, le=1.0)
    clarity: float = Field(ge=0.0, le=1.0)
    groundedness: float = Field(ge=0.0, le=1.0)
    efficiency: float = Field(ge=0.0, le=1.0)
    reason: str = Field(max_length=400)


REVIEW_SCHEMAS = {"review": Review, "protocol": Protocol}
