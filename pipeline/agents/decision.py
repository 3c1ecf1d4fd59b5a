"""The principal investigator's one decision path: how its decision is asked, read and explained, wherever it decides.

The society's PI node, role-level evaluation (what the gate reads), the report, ``train_prompt``'s metric and
``train_pi``'s rows all go through here, so the decision the society serves is the decision that was trained and gated,
by construction (issue #57: a PI gated on a one-token readout and served under a JSON grammar failed 13 of 30 test
rollouts and agreed with its readout on 10 of 30).

1. **Decide** at the trained position: the PI's messages (:func:`decision_messages`), its answer continued from
   ``agents.decision.prefix`` (what the base model writes before the decision under ``PIDecision``'s schema) for one
   token. The decision is read from that token's probabilities over the three decisions (``Decision``: GO, NO-GO,
   DEFER for PubMedQA's yes, no, maybe): the most probable. No grammar and no repair loop: the only ways to fail are a
   decision position none of whose listed alternatives spells a decision, and a call that is refused.
2. **Explain** with the decision fixed: the answer continued from the prefix, the decision and the rationale key
   (the JSON layout ``train_pi`` trains, ``indent=2``), as free text until its string closes or
   ``agents.decision.rationale_tokens``. A rationale never changes the decision.

What the decision reads (``agents.decision.input``): ``brief``, the evidence brief alone (what ``train_pi`` trains on
and role-level evaluation gates), or ``society``, the brief with the society's protocol and reviews. The rationale
reads the society's protocol and reviews either way (a role-level call has none: ``NO_PROTOCOL``). docs/promotion.md
has the measurement that chose.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from pydantic import BaseModel

from pipeline.agents.llm import LLMError, RoleClient
from pipeline.agents.prompts import NO_PROTOCOL, Prompts, brief, pi_prompt
from pipeline.config import AgentsParams, DecisionInput, DecisionParams
from pipeline.schemas import Decision, PIDecision

TOP_LOGPROBS = 20  # enough that every decision's first token is listed at the decision position
RATIONALE_CHARS = PIDecision.model_fields["rationale"].metadata[0].max_length


class Answer(BaseModel):
    """What the PI served for one question: its decision (None: failed, ``error`` says why), the decision's
    probabilities, and the rationale written after it."""

    decision: Decision | None
    p_go: float | None  # P(GO) against NO-GO alone: what the AUC between yes and no questions reads
    probs: dict[str, float]  # each decision's share of the mass listed at the decision position
    rationale: str | None
    error: str | None = None
    tokens: int = 0
    latency_s: float = 0.0
    deployment: str | None = None  # what the proxy says answered (a LoRA deployment's name carries its digest)

    def as_pi_decision(self) -> dict[str, Any]:
        """The society's ``decision`` state: a valid ``PIDecision`` (cut to its schema) and the probabilities."""
        obj = PIDecision(decision=self.decision.value if self.decision else "NO-GO",  # type: ignore[arg-type]
                         rationale=(self.rationale or "")[:RATIONALE_CHARS])
        return {**obj.model_dump(), "p_go": self.p_go, "probs": self.probs}


def decision_messages(task: dict[str, Any], agents: AgentsParams, setting: str, prompts: Prompts, protocol: Any = None,
                      reviews: list[dict[str, Any]] | None = None, what: DecisionInput | None = None) -> list[dict[str, str]]:
    """The PI's chat for ``task`` rendered from ``prompts`` (the society's, or a candidate's): the evidence brief, with
    the society's protocol and reviews when ``what`` (default ``agents.decision.input``) is ``society``."""
    if (what or agents.decision.input) == DecisionInput.BRIEF or protocol is None:
        protocol, reviews = NO_PROTOCOL, []
    return [{"role": "user", "content": pi_prompt(prompts, brief(task, agents.context_chars, setting), protocol, reviews or [])}]


def rationale_prefix(prefix: str, decision: Decision) -> str:
    """The answer so far when the rationale is written: the decision fixed, in the layout train_pi trains."""
    return f'{prefix}{decision.value}",\n  "rationale": "'


def _word(token: str) -> str:
    return token.strip().lstrip('"').strip()


def _spells(word: str) -> Decision | None:
    """The decision whose spelling starts with this token (GO, NO-GO and DEFER start apart), or None."""
    found = [d for d in Decision if word and d.value.startswith(word)]
    return found[0] if len(found) == 1 else None


def read(top: list[dict[str, Any]]) -> tuple[Decision | None, float | None, dict[str, float]]:
    """(decision, P(GO) against NO-GO, each decision's share) from the alternatives listed at the decision position."""
    mass = dict.fromkeys(Decision, 0.0)
    for t in top:
        if (d := _spells(_word(t["token"]))) is not None:
            mass[d] += math.exp(t["logprob"])
    total = sum(mass.values())
    if total <= 0:
        return None, None, {}
    probs = {d.value: m / total for d, m in mass.items()}
    pair = mass[Decision.GO] + mass[Decision.NO_GO]
    return max(mass, key=mass.__getitem__), (mass[Decision.GO] / pair if pair > 0 else None), probs


def read_first(content: list[dict[str, Any]]) -> tuple[Decision | None, float | None, dict[str, float]]:
    """:func:`read` at the first generated token (the decision position) of a completion's logprobs content."""
    return read(content[0].get("top_logprobs") or []) if content else (None, None, {})


def read_completion(doc: dict[str, Any]) -> tuple[Decision | None, float | None, dict[str, float]]:
    """:func:`read_first` on an OpenAI chat completion continued from the decision prefix."""
    return read_first(((doc["choices"][0].get("logprobs") or {}).get("content")) or [])


def request(messages: list[dict[str, str]], model: str, prefix: str) -> dict[str, Any]:
    """The decision call as an OpenAI chat request (for a caller without a :class:`RoleClient`: train_prompt's metric)."""
    return {"model": model, "messages": [*messages, {"role": "assistant", "content": prefix}], "max_tokens": 1,
            "temperature": 0.0, "logprobs": True, "top_logprobs": TOP_LOGPROBS, "continue_final_message": True,
            "add_generation_prompt": False}


def _closed(text: str) -> str:
    """The rationale string as the model closed it (at its first unescaped quote), unescaped."""
    out, escaped = [], False
    for ch in text:
        if escaped:
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            break
        else:
            out.append(ch)
    return "".join(out).strip()


async def ask(client: RoleClient, agent: str, model: str, cfg: DecisionParams, decide_on: list[dict[str, str]],
              explain_on: list[dict[str, str]] | None, spans: list[dict[str, Any]], prompt: str | None = None) -> Answer:
    """The PI's served answer: the decision read at ``cfg.prefix`` on ``decide_on``, then (``explain_on`` given) the
    rationale written on ``explain_on`` after it. Every call is a span in ``spans``; a refused call is the answer's
    ``error``, never raised."""
    t0, tokens = time.perf_counter(), 0
    try:
        await client.chat(agent, model, decide_on, spans, max_tokens=1, temperature=0.0, top_logprobs=TOP_LOGPROBS,
                          prompt=prompt, continue_from=cfg.prefix)
    except LLMError as exc:
        return Answer(decision=None, p_go=None, probs={}, rationale=None, error=str(exc), latency_s=time.perf_counter() - t0)
    call = spans[-1]["data"]
    decision, p_go, probs = read_first(call.pop("logprobs", None) or [])  # read here and dropped: traces stay small
    tokens += (call.get("usage") or {}).get("total_tokens", 0)
    call.update(decision=decision.value if decision else None, p_go=p_go, probs=probs, step="decision")
    deployment = call.get("deployment")
    if decision is None:
        return Answer(decision=None, p_go=None, probs={}, rationale=None, error="no decision token at the decision position",
                      tokens=tokens, latency_s=time.perf_counter() - t0, deployment=deployment)
    why = None
    if explain_on is not None:
        try:
            text = await client.chat(agent, model, explain_on, spans, max_tokens=cfg.rationale_tokens, temperature=0.0,
                                     prompt=prompt, continue_from=rationale_prefix(cfg.prefix, decision), stop=['"'])
        except LLMError as exc:
            return Answer(decision=None, p_go=p_go, probs=probs, rationale=None, error=str(exc), tokens=tokens,
                          latency_s=time.perf_counter() - t0, deployment=deployment)
        spans[-1]["data"]["step"] = "rationale"
        tokens += (spans[-1]["data"].get("usage") or {}).get("total_tokens", 0)
        why = _closed(text)[:RATIONALE_CHARS]
    return Answer(decision=decision, p_go=p_go, probs=probs, rationale=why, tokens=tokens,
                  latency_s=time.perf_counter() - t0, deployment=deployment)


def target(label: str, rationale: str) -> str:
    """The answer ``train_pi`` trains for a label, in the served layout: the decision first, then its rationale."""
    obj = PIDecision(decision=Decision.for_label(label).value, rationale=rationale[:RATIONALE_CHARS])  # type: ignore[arg-type]
    return json.dumps(obj.model_dump(), indent=2)
