"""The society as a LangGraph graph.

START ─┬─ geneticist ─────┐                                      ┌─ peer_reviewer ──┐
       ├─ pharmacologist ─┼─► supervisor ─► refiner ─► designer ─┤                  ├─► close_round ─┐
       └─ neurologist ────┘                   ▲            ▲       └─ safety_officer ─┘                │
                                              └ CRITICAL ──┴── MAJOR ◄────────── route by severity ◄───┘
                                                                    MINOR/APPROVE or budget ─► principal_investigator ─► END
(no hypothesis at all: supervisor ─► END, and the rollout fails without spending senior calls)

Juniors run ReAct loops inside their node: each step asks for a ``ToolCall``; the tool result goes
back to the calling agent (recorded as ``sender`` on the tool span) until it answers with a
``Hypothesis``. The review board (peer reviewer and safety officer) reviews each protocol
concurrently: neither prompt includes the other's review, so running them one after the other
(``agents.concurrent_reviews: false``) only lengthens the chain by one call per round; the round
closes when both have answered and is routed by the worst severity of the two either way.
Every node catches its own errors into the state, so a rollout never raises.
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from pipeline.agents import decision
from pipeline.agents.llm import DESIGNER_TOKENS, LLMError, RoleClient
from pipeline.agents.prompts import SETTINGS, brief
from pipeline.agents.tools import Toolbox, timed_call
from pipeline.config import AgentsParams, DecisionInput
from pipeline.schemas import EvidenceCall, Hypothesis, Protocol, Review, StructuredOutput, SupervisorChoice, ToolCall

JUNIORS = {
    "geneticist": "a geneticist: genes, variants, heritability",
    "pharmacologist": "a pharmacologist: drugs, doses, mechanisms, interactions",
    "neurologist": "a neurologist: nervous system, cognition, clinical neurology",
}
# the agents whose calls open every rollout (the juniors, from START): a candidate for their logical model has no call
# of the champion's before its own to replay, so evaluate runs it beside the champion rather than after it
OPENING_AGENTS = tuple(JUNIORS)
AGENTS = (*JUNIORS, "supervisor", "hypothesis_refiner", "protocol_designer", "peer_reviewer", "safety_officer",
          "principal_investigator")  # every agent of the graph: each must be answered by a role (roles.<r>.agents)
INSTRUMENTS = ("judge",)  # agents of a role that score the society rather than take part in it
SEVERITY_RANK = {"APPROVE": 0, "MINOR": 1, "MAJOR": 2, "CRITICAL": 3}


class SocietyState(TypedDict, total=False):
    task: dict[str, Any]
    hypotheses: Annotated[list[dict[str, Any]], operator.add]
    selection: dict[str, Any]
    refined: dict[str, Any]
    protocol: dict[str, Any]
    reviews: Annotated[list[dict[str, Any]], operator.add]
    review_round: int
    decision: dict[str, Any]
    spans: Annotated[list[dict[str, Any]], operator.add]
    errors: Annotated[list[str], operator.add]


@dataclass
class Society:
    client: RoleClient
    tools: Toolbox
    cfg: AgentsParams
    rng: random.Random
    policy: Any = None  # a trained supervisor policy (``pipeline.bandit.policy.BanditPolicy``); None = the LLM supervisor

    def __post_init__(self) -> None:
        if missing := [a for a in AGENTS if a not in self.cfg.models]:
            raise ValueError(f"params.yaml roles: no role's agents name {missing}; every agent of the graph needs one")
        if unknown := sorted(set(self.cfg.models) - {*AGENTS, *INSTRUMENTS}):  # a misspelt agent would answer nothing
            raise ValueError(f"params.yaml roles: agents {unknown} are not agents of the graph {list(AGENTS)}")

    def _llm_calls(self, state: SocietyState) -> int:
        return sum(1 for s in state.get("spans", []) if s["kind"] == "llm")

    @staticmethod
    def _question(state: SocietyState) -> str:
        return state["task"]["question"]

    def _brief(self, state: SocietyState) -> str:
        # data.setting rides on the task (load_tasks' setting): what the juniors and the PI read of it
        return brief(state["task"], self.cfg.context_chars, state["task"].get("setting", SETTINGS[0]))

    def junior(self, name: str):
        async def node(state: SocietyState) -> dict[str, Any]:
            spans: list[dict[str, Any]] = []
            system = self._render("junior.system", persona=JUNIORS[name], brief=self._brief(state))
            notes: list[str] = []
            try:
                for step in range(self.cfg.max_tool_calls):
                    messages = [{"role": "system", "content": system},
                                {"role": "user", "content": self._render("junior.step", notes="\n".join(notes) or "none")}]
                    schema: type[ToolCall | EvidenceCall] = EvidenceCall if step < self.cfg.min_tool_calls else ToolCall
                    call = await self.client.structured(name, self.cfg.models[name], messages, schema, spans, max_tokens=64,
                                                        prompt="junior.step")
                    if call is None or call.tool == "none":
                        break
                    result = timed_call(self.tools, name, call.tool, call.query, spans)
                    notes.append(f"[{call.tool}({call.query})] {result.text[:600]}")
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": self._render("junior.hypothesis", notes="\n".join(notes) or "none")}]
                hyp = await self.client.structured(name, self.cfg.models[name], messages, Hypothesis, spans,
                                                   prompt="junior.hypothesis")
            except LLMError as exc:
                return {"spans": spans, "errors": [str(exc)]}
            if hyp is None:
                return {"spans": spans, "errors": [f"{name}: no valid hypothesis"]}
            return {"spans": spans, "hypotheses": [{"author": name, **hyp.model_dump()}]}

        return node

    async def supervisor(self, state: SocietyState) -> dict[str, Any]:
        spans: list[dict[str, Any]] = []
        candidates = sorted(state.get("hypotheses", []), key=lambda h: list(JUNIORS).index(h["author"]))
        if not candidates:
            return {"errors": ["supervisor: no hypotheses to choose from"]}
        k = len(candidates)
        logged: dict[str, Any] = {"candidates": [h["author"] for h in candidates], "context": self._question(state),
                                  "candidate_hypotheses": candidates}
        if self.policy is not None:
            # the trained bandit decides with its own exploration; its probability of the pick is the propensity
            pmf = self.policy.pmf(self._question(state), candidates)
            chosen = self.rng.choices(range(k), weights=pmf)[0]
            model_pick = max(range(k), key=pmf.__getitem__)
            logged.update(policy="bandit", policy_source=self.policy.source, pmf=pmf, model_choice=model_pick, chosen=chosen,
                          explored=chosen != model_pick, propensity=pmf[chosen], reason="contextual bandit")
        else:
            listing = "\n".join(f"{i}. ({h['author']}) {h['hypothesis']}" for i, h in enumerate(candidates))
            messages = [{"role": "system", "content": self._render("supervisor.system")},
                        {"role": "user", "content": self._render("supervisor.choice", question=self._question(state),
                                                                  listing=listing)}]
            try:
                choice = await self.client.structured("supervisor", self.cfg.models["supervisor"], messages,
                                                      SupervisorChoice, spans,
                                                      max_tokens=128, prompt="supervisor.choice")
            except LLMError as exc:
                return {"spans": spans, "errors": [str(exc)]}
            model_pick = choice.chosen if choice is not None and choice.chosen < k else 0
            explored = self.rng.random() < self.cfg.epsilon
            chosen = self.rng.randrange(k) if explored else model_pick
            pmf = [(1 - self.cfg.epsilon) * (i == model_pick) + self.cfg.epsilon / k for i in range(k)]  # epsilon-greedy
            logged.update(policy="llm", pmf=pmf, model_choice=model_pick, chosen=chosen, explored=explored,
                          propensity=pmf[chosen], epsilon=self.cfg.epsilon,
                          reason=choice.reason if choice else "invalid choice; defaulted to 0")
        spans.append({"kind": "decision", "name": "supervisor", "data": logged})
        return {"spans": spans, "selection": {**candidates[chosen], "index": chosen, "propensity": logged["propensity"]}}

    def _render(self, template: str, **fields: Any) -> str:
        """``template`` as this society renders it: the version its client's prompts carry (the routed one)."""
        return self.client.prompts.render(template, **fields)

    async def _senior(self, agent: str, schema: type[StructuredOutput], template: str, fields: dict[str, Any],
                      key: str, tokens: int | None = None) -> dict[str, Any]:
        spans: list[dict[str, Any]] = []
        try:
            obj = await self.client.structured(agent, self.cfg.models[agent], [{"role": "user", "content": self._render(
                template, **fields)}], schema, spans, max_tokens=tokens, prompt=template)
        except LLMError as exc:
            return {"spans": spans, "errors": [str(exc)]}
        if obj is None:
            return {"spans": spans, "errors": [f"{agent}: no valid {schema.__name__}"]}
        return {"spans": spans, key: obj.model_dump()}

    async def refiner(self, state: SocietyState) -> dict[str, Any]:
        base = state.get("refined") or state.get("selection") or {}
        critique = "\n".join(f"- {r['severity']}: {r['summary']}" for r in state.get("reviews", [])[-2:])
        fields = {"question": self._question(state), "hypothesis": base.get("hypothesis", ""), "critique": critique or "none"}
        return await self._senior("hypothesis_refiner", Hypothesis, "refiner", fields, "refined")

    async def designer(self, state: SocietyState) -> dict[str, Any]:
        hyp = (state.get("refined") or state.get("selection") or {}).get("hypothesis", "")
        critique = "\n".join(f"- {r['severity']}: {'; '.join(r['issues'])}" for r in state.get("reviews", [])[-2:])
        return await self._senior("protocol_designer", Protocol, "designer",
                                  {"hypothesis": hyp, "critique": critique or "none"}, "protocol",
                                  tokens=DESIGNER_TOKENS * self.cfg.max_tokens)

    def reviewer(self, agent: str, focus: str):
        async def node(state: SocietyState) -> dict[str, Any]:
            fields = {"focus": focus, "question": self._question(state), "protocol": state.get("protocol")}
            out = await self._senior(agent, Review, "reviewer", fields, "review",
                                     tokens=2 * self.cfg.max_tokens)
            if "review" in out:
                out["reviews"] = [{"reviewer": agent, "round": state.get("review_round", 0), **out.pop("review")}]
            return out

        return node

    async def close_round(self, state: SocietyState) -> dict[str, Any]:
        return {"review_round": state.get("review_round", 0) + 1}

    def route(self, state: SocietyState) -> str:
        """CRITICAL -> refiner, MAJOR -> designer, otherwise (or out of budget) -> PI."""
        if state.get("review_round", 0) > self.cfg.max_review_rounds or self._llm_calls(state) >= self.cfg.max_turns:
            return "principal_investigator"
        this_round = [r for r in state.get("reviews", []) if r["round"] == state.get("review_round", 1) - 1]
        worst = max((SEVERITY_RANK[r["severity"]] for r in this_round), default=0)
        return {3: "refiner", 2: "designer"}.get(worst, "principal_investigator")

    async def principal_investigator(self, state: SocietyState) -> dict[str, Any]:
        """The PI decides by the one decision path it is trained and gated on (pipeline/agents/decision.py)."""
        agent, spans = "principal_investigator", list[dict[str, Any]]()
        task, setting = state["task"], state["task"].get("setting", SETTINGS[0])
        protocol, reviews, prompts = state.get("protocol"), state.get("reviews", []), self.client.prompts
        answer = await decision.ask(
            self.client, agent, self.cfg.models[agent], self.cfg.decision,
            decision.decision_messages(task, self.cfg, setting, prompts, protocol, reviews),
            decision.decision_messages(task, self.cfg, setting, prompts, protocol, reviews, what=DecisionInput.SOCIETY),
            spans, prompt=agent)
        if answer.decision is None:
            return {"spans": spans, "errors": [f"{agent}: {answer.error}"]}
        return {"spans": spans, "decision": answer.as_pi_decision()}

    def compile(self) -> Any:
        g = StateGraph(SocietyState)
        for name in JUNIORS:
            g.add_node(name, self.junior(name))
            g.add_edge(START, name)
        g.add_node("supervisor", self.supervisor)
        g.add_edge(list(JUNIORS), "supervisor")
        g.add_node("refiner", self.refiner)
        g.add_node("designer", self.designer)
        g.add_node("peer_reviewer", self.reviewer("peer_reviewer", "peer reviewer (scientific rigour)"))
        g.add_node("safety_officer", self.reviewer("safety_officer", "safety officer (ethics, biosafety, patient risk)"))
        g.add_node("close_round", self.close_round)
        g.add_node("principal_investigator", self.principal_investigator)
        # no junior produced a hypothesis: nothing to refine, the rollout ends (and fails) here
        g.add_conditional_edges("supervisor", lambda state: "refiner" if state.get("selection") else END, ["refiner", END])
        g.add_edge("refiner", "designer")
        if self.cfg.concurrent_reviews:
            g.add_edge("designer", "peer_reviewer")
            g.add_edge("designer", "safety_officer")
            g.add_edge(["peer_reviewer", "safety_officer"], "close_round")  # waits for both
        else:
            g.add_edge("designer", "peer_reviewer")
            g.add_edge("peer_reviewer", "safety_officer")
            g.add_edge("safety_officer", "close_round")
        g.add_conditional_edges("close_round", self.route, ["refiner", "designer", "principal_investigator"])
        g.add_edge("principal_investigator", END)
        return g.compile()
