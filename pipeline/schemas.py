"""Structured outputs of the society and the judge, as pydantic models.

The same classes give the JSON schema sent as ``response_format`` (vLLM guided decoding through
the proxy) and validate what comes back. Fields are few and short on purpose: a 135M model must be
able to fill them within the token budget.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Every string is bounded, list items included: guided decoding enforces maxLength, and a small
# model at low temperature can otherwise repeat inside one string until max_tokens cuts the JSON.
Item = Annotated[str, StringConstraints(max_length=160)]
# An identifier keeps its length at any agents.text_scale: a PMID cut to 5 of its 8 digits names another paper.
KEEP_LENGTH = "x-keep-length"
Pmid = Annotated[str, StringConstraints(max_length=12), Field(json_schema_extra={KEEP_LENGTH: True})]


class StructuredOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def token_budget(cls, text_scale: float = 1.0) -> int:
        """Completion tokens that always hold a complete answer. Guided decoding bounds every string
        (maxLength) and list (maxItems), so the JSON ends within this; a lower cap cuts it into invalid
        JSON that no repair attempt fixes (CI saw three juniors of one rollout fail that way). Counted at
        2 characters a token (URL-like text from a small model is that dense), plus JSON punctuation."""
        return _budget(cls.json_schema(text_scale)) + 8

    @classmethod
    def json_schema(cls, text_scale: float = 1.0) -> dict[str, Any]:
        """The schema guided decoding enforces: every string's maxLength times ``text_scale`` (agents.text_scale;
        validation keeps the full lengths, so a shorter answer is always valid); an identifier keeps its own."""
        return _scaled(cls.model_json_schema(), text_scale)

    @classmethod
    def response_format(cls, text_scale: float = 1.0) -> dict[str, Any]:
        """OpenAI ``response_format`` for this schema (strict JSON schema)."""
        schema = cls.json_schema(text_scale)
        return {"type": "json_schema", "json_schema": {"name": cls.__name__, "schema": schema, "strict": True}}


def _scaled(node: Any, scale: float) -> Any:
    if isinstance(node, list):
        return [_scaled(n, scale) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _scaled(v, scale) for k, v in node.items() if k != KEEP_LENGTH}
    if out.get("type") == "string" and "maxLength" in out and not node.get(KEEP_LENGTH):
        out["maxLength"] = max(1, round(out["maxLength"] * scale))
    return out


def _budget(node: dict[str, Any]) -> int:
    if "enum" in node or "const" in node:
        values = node.get("enum") or [node.get("const")]
        return max(len(str(v)) for v in values) // 2 + 4
    if options := node.get("anyOf") or node.get("oneOf"):
        return max(_budget(o) for o in options)
    kind = node.get("type")
    if kind == "string":
        return node.get("maxLength", 512) // 2 + 4
    if kind == "array":
        return node.get("maxItems", 8) * (_budget(node.get("items", {})) + 2) + 4
    if kind == "object":
        return sum(_budget(p) + 8 for p in node.get("properties", {}).values()) + 4
    return 8  # numbers, booleans, null


class Hypothesis(StructuredOutput):
    hypothesis: str = Field(max_length=400)
    rationale: str = Field(max_length=400)
    evidence_pmids: list[Pmid] = Field(default_factory=list, max_length=5)


class SupervisorChoice(StructuredOutput):
    chosen: int = Field(ge=0, le=2, description="index of the selected junior hypothesis")
    reason: str = Field(max_length=400)


class Protocol(StructuredOutput):
    title: str = Field(max_length=120)
    objective: str = Field(max_length=300)
    methods: list[Item] = Field(min_length=1, max_length=5)
    controls: list[Item] = Field(default_factory=list, max_length=3)
    outcome_measures: list[Item] = Field(min_length=1, max_length=3)


class Review(StructuredOutput):
    severity: Literal["CRITICAL", "MAJOR", "MINOR", "APPROVE"]
    issues: list[Item] = Field(default_factory=list, max_length=3)
    summary: str = Field(max_length=300)


class Decision(StrEnum):
    """The PI's decisions and the PubMedQA answer each stands for: the one home of that mapping."""

    GO = "GO"  # the evidence supports it: yes
    NO_GO = "NO-GO"  # the evidence refutes it: no
    DEFER = "DEFER"  # the evidence is inconclusive: maybe

    @property
    def answer(self) -> str:
        return {Decision.GO: "yes", Decision.NO_GO: "no", Decision.DEFER: "maybe"}[self]

    @classmethod
    def for_label(cls, label: str) -> Decision:
        """The decision a PubMedQA label asks for."""
        return next(d for d in cls if d.answer == label)


ANSWER = {d.value: d.answer for d in Decision}  # decision -> PubMedQA answer


class PIDecision(StructuredOutput):
    decision: Literal["GO", "NO-GO", "DEFER"]
    # 300 characters: a GO/NO-GO's reasons (the protocol carries the detail); at 600 the CPU GRPO trainer's sampled
    # rationales ran past its completion cap (a cut completion is malformed JSON) and took minutes a step
    rationale: str = Field(max_length=300)


# The judge scores each criterion with one digit 0-9 (an enum to guided decoding; one token each): a float
# field let a small model decode greedily (judge.temperature 0) into "0.8888888..." until the token cap cut
# the JSON. pipeline.rewards.judge reads the expected digit from the token's probabilities, not the argmax.
Score = Literal[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


class JudgeScores(StructuredOutput):
    novelty: Score
    feasibility: Score
    impact: Score
    clarity: Score
    groundedness: Score
    efficiency: Score
    reason: str = Field(max_length=400)


REVIEW_SCHEMAS = {"review": Review, "protocol": Protocol}


class ToolCall(StructuredOutput):
    """One ReAct step of a junior: call a tool, or stop and write the hypothesis."""

    tool: Literal["search_literature", "lookup_gene", "lookup_protein", "none"]
    query: str = Field(max_length=80)


class EvidenceCall(StructuredOutput):
    """A ReAct step that must call a tool: the first ``agents.min_tool_calls`` steps of a junior use this schema,
    so guided decoding cannot skip the evidence search (a tiny model otherwise often answers 'none' at once)."""

    tool: Literal["search_literature", "lookup_gene", "lookup_protein"]
    query: str = Field(max_length=80)


def named(name: str) -> type[StructuredOutput] | None:
    """The schema a traced call was decoded under (an LLM span records its class name), or None."""
    return next((c for c in StructuredOutput.__subclasses__() if c.__name__ == name), None)
