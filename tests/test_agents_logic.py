"""Pure logic of the society, reward and rollout journal (no model calls)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest

from pipeline.agents.graph import Society
from pipeline.agents.prompts import REPOSITORY
from pipeline.agents.tools import Toolbox, build_index
from pipeline.config import load_params
from pipeline.rewards.judge import alignment, weighted_reward
from pipeline.stages.rollouts import read_journal, summarise
from tests.conftest import ROOT, SOURCE, section


def _society(**cfg) -> Society:
    return Society(client=None, tools=None, cfg=section("agents", **cfg), rng=random.Random(0))  # type: ignore[arg-type]


def _state(*severities: str, round_: int = 1, calls: int = 3) -> dict:
    return {"review_round": round_, "reviews": [{"severity": s, "round": round_ - 1, "reviewer": f"r{i}"} for i, s in enumerate(severities)],
            "spans": [{"kind": "llm"}] * calls}


@pytest.mark.parametrize("severities, target", [
    (("CRITICAL", "MINOR"), "refiner"), (("MAJOR", "APPROVE"), "designer"), (("MINOR", "APPROVE"), "principal_investigator"),
    (("APPROVE", "APPROVE"), "principal_investigator"), (("MAJOR", "CRITICAL"), "refiner"), ((), "principal_investigator"),
])
def test_route_by_worst_severity(severities, target) -> None:
    assert _society(max_review_rounds=2).route(_state(*severities)) == target


def test_route_ends_loops_on_budget() -> None:
    s = _society(max_review_rounds=1, max_turns=10)
    assert s.route(_state("CRITICAL", round_=2)) == "principal_investigator"       # review rounds spent
    assert s.route(_state("CRITICAL", round_=1, calls=10)) == "principal_investigator"  # LLM-call budget spent
    assert s.route(_state("CRITICAL", round_=1, calls=9)) == "refiner"


def test_only_the_latest_round_counts() -> None:
    state = _state("MINOR", round_=2)
    state["reviews"].insert(0, {"severity": "CRITICAL", "round": 0, "reviewer": "old"})
    assert _society().route(state) == "principal_investigator"


def test_weighted_reward_and_alignment() -> None:
    weights = load_params(ROOT / "params.yaml", environ={}).judge.weights.model_dump()
    assert weighted_reward({c: 1.0 for c in weights}, weights) == pytest.approx(1.0)
    assert weighted_reward({"groundedness": 1.0}, weights) == pytest.approx(weights["groundedness"] / sum(weights.values()))
    assert alignment("GO", "yes") == {"aligned": True, "maybe": False}
    assert alignment("NO-GO", "yes") == {"aligned": False, "maybe": False}
    assert alignment("GO", "maybe") == {"aligned": None, "maybe": True}
    assert alignment(None, "no")["aligned"] is None


def test_journal_drops_truncated_line_and_dedupes(tmp_path: Path) -> None:
    path = tmp_path / "j"
    a = json.dumps({"rollout_id": "1-0", "v": 1})
    b = json.dumps({"rollout_id": "2-0", "v": 1})
    a2 = json.dumps({"rollout_id": "1-0", "v": 2})
    path.write_text(f"{a}\n{b}\n{a2}\n" + '{"rollout_id": "3-0", "v"')
    done = read_journal(path)
    assert set(done) == {"1-0", "2-0"} and json.loads(done["1-0"])["v"] == 2


def test_foreign_journal_is_set_aside_not_merged(tmp_path: Path) -> None:
    from pipeline.stages.rollouts import open_journal

    (tmp_path / "rollouts").mkdir()
    path = tmp_path / "rollouts" / ".shard-00000.jsonl.partial"
    a = json.dumps({"rollout_id": "1-0", "v": 1})
    path.write_text(json.dumps({"journal_config": "k1"}) + "\n" + a + "\n" + '{"rollout_id": "2-0", "v"')
    assert open_journal(path, "k1") == {"1-0": a}  # same configuration: resumed, the cut line dropped
    assert path.read_text() == json.dumps({"journal_config": "k1"}) + "\n" + a + "\n"
    assert open_journal(path, "k2") == {}  # another configuration (e.g. a promotion since): not merged
    assert (tmp_path / ".rollouts.shard-00000.jsonl.partial.foreign-k1").read_text().count("1-0") == 1  # beside the output folder
    path.write_text(a + "\n")  # a journal from before journals carried their configuration
    assert open_journal(path, "k2") == {} and (tmp_path / ".rollouts.shard-00000.jsonl.partial.foreign-unversioned").exists()
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [path.name]  # nothing else inside the output folder


def test_a_second_writer_on_a_shard_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    from pipeline.stages.rollouts import shard_lock

    (tmp_path / "rollouts").mkdir()
    journal = tmp_path / "rollouts" / ".shard-00000.jsonl.partial"
    other = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; from pipeline.stages.rollouts import shard_lock\n"
             f"with shard_lock(Path({str(journal)!r})): pass")
    with shard_lock(journal):
        proc = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True)
        assert proc.returncode != 0 and "another process is writing this shard" in proc.stderr
    assert subprocess.run([sys.executable, "-c", other], capture_output=True, text=True).returncode == 0  # released
    assert not any((tmp_path / "rollouts").iterdir())  # the lock is not in the output folder


def test_summarise_counts_failures_and_components() -> None:
    traces = [{"status": "ok", "turns": 10, "tokens": 100, "latency_s": 1.0, "reward": 0.5, "label": "yes", "rewards": {"novelty": 0.5, "aligned": 1.0}},
              {"status": "failed", "turns": 0, "tokens": 0, "latency_s": 0.1, "reward": None, "label": "maybe", "rewards": {}}]
    s = summarise(traces)
    assert s["success_rate"] == 0.5 and s["mean_reward"] == 0.5 and s["mean_aligned"] == 1.0 and s["maybe_labels"] == 1


def test_tools_offline(tmp_path: Path) -> None:
    data = json.loads(SOURCE.read_text())
    frame = pd.DataFrame([{"id": k, "question": v["QUESTION"], "contexts": v["CONTEXTS"], "meshes": v["MESHES"]} for k, v in list(data.items())[:200]])
    stats = build_index([frame], tmp_path / "index")
    assert stats["abstracts"] == 200 and stats["protein_headings"] > 0
    box = Toolbox(tmp_path / "index", top_k=2)
    first = frame.iloc[0]
    hit = box.call("search_literature", first["question"])
    assert hit.ok and hit.data[0]["pmid"] == first["id"]
    assert box.call("lookup_protein", "receptor").ok
    assert not box.call("fly", "x").ok and not box.call("lookup_gene", "  ").ok
    broken = Toolbox(tmp_path / "missing")
    result = broken.call("search_literature", "statins")
    assert not result.ok and "build-index" in result.text  # an error message for the agent, not an exception


class _QuitterClient:
    """A junior model that stops at once whenever the schema lets it ('none'), else searches."""

    prompts = REPOSITORY

    def __init__(self) -> None:
        self.schemas: list[str] = []

    async def structured(self, agent, model, messages, schema, spans, max_tokens=None, prompt=None):
        self.schemas.append(schema.__name__)
        fields = schema.model_fields
        if "tool" in fields:
            allowed = fields["tool"].annotation.__args__
            return schema(tool="none" if "none" in allowed else "search_literature", query="statins")
        return schema(hypothesis="h", rationale="r", evidence_pmids=[]) if "hypothesis" in fields else None


@pytest.mark.parametrize("min_calls, max_calls, tool_spans", [(1, 2, 1), (2, 2, 2), (0, 2, 0), (3, 1, 1)])
def test_junior_looks_up_evidence_before_it_may_stop(tmp_path: Path, min_calls: int, max_calls: int, tool_spans: int) -> None:
    import asyncio

    client = _QuitterClient()
    society = Society(client=client, tools=Toolbox(tmp_path / "no-index"), cfg=section("agents", min_tool_calls=min_calls, max_tool_calls=max_calls),  # type: ignore[arg-type]
                      rng=random.Random(0))
    out = asyncio.run(society.junior("geneticist")({"task": {"question": "Do statins help?"}}))
    assert sum(1 for s in out["spans"] if s["kind"] == "tool" and s["data"]["sender"] == "geneticist") == tool_spans
    assert out["hypotheses"][0]["author"] == "geneticist"


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("name", ["Hypothesis", "EvidenceCall", "ToolCall", "SupervisorChoice", "Review", "PIDecision", "JudgeScores"])
def test_token_budget_holds_the_longest_answer_the_schema_allows(name: str, scale: float) -> None:
    """Every string at its maxLength, every list at its maxItems, pretty-printed as a model writes it:
    at 2 characters a token it fits the budget, so a cap of token_budget() never truncates the JSON. With
    agents.text_scale below 1 the schema sent to guided decoding has shorter strings, and so a smaller budget."""
    from pipeline import schemas

    cls = getattr(schemas, name)
    schema = cls.json_schema(scale)
    assert cls.response_format(scale)["json_schema"]["schema"] == schema

    def longest(node: dict):
        if "enum" in node:
            return max(node["enum"], key=lambda v: len(str(v)))
        kind = node.get("type")
        if kind == "string":
            return "x" * node.get("maxLength", 0)
        if kind == "array":
            return [longest(node["items"])] * node.get("maxItems", 0)
        return node.get("maximum", 1)

    doc = {k: longest(v) for k, v in schema["properties"].items()}
    text = json.dumps(doc, indent=2)
    cls.model_validate_json(text)
    assert len(text) / 2 <= cls.token_budget(scale), (len(text), cls.token_budget(scale))
    if scale < 1:  # every schema has free text: a shorter answer, a smaller cap
        assert cls.token_budget(scale) < cls.token_budget()


def test_a_shorter_text_scale_shortens_free_text_but_never_an_identifier() -> None:
    """At agents.text_scale 0.25 a hypothesis is a quarter as long, and its evidence PMIDs still hold 8 digits (a PMID
    cut to 5 names another paper); the marker that keeps them is not sent to the grammar."""
    from pipeline.schemas import Hypothesis

    full, short = Hypothesis.json_schema(), Hypothesis.json_schema(0.25)
    assert short["properties"]["hypothesis"]["maxLength"] == full["properties"]["hypothesis"]["maxLength"] // 4
    assert short["properties"]["evidence_pmids"]["items"]["maxLength"] == 12
    Hypothesis.model_validate({"hypothesis": "h", "rationale": "r", "evidence_pmids": ["25735444"]})
    assert "x-keep-length" not in json.dumps(full) + json.dumps(short)


class _ScriptedClient:
    """A whole society's answers: the safety officer finds a CRITICAL problem in round 0 only, so the graph must
    go back to the refiner once; each reviewer takes a moment, so reviews in flight at once can be counted."""

    prompts = REPOSITORY

    def __init__(self) -> None:
        self.agents: list[str] = []
        self.pi_calls: list[dict] = []
        self.in_flight = self.most_in_flight = 0

    async def structured(self, agent, model, messages, schema, spans, max_tokens=None, prompt=None):
        import asyncio

        from pipeline import schemas

        self.agents.append(agent)
        spans.append({"kind": "llm", "name": agent, "data": {"agent": agent}})
        if schema is schemas.Review:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            await asyncio.sleep(0.05)
            self.in_flight -= 1
            critical = agent == "safety_officer" and self.agents.count("safety_officer") == 1
            return schemas.Review(severity="CRITICAL" if critical else "MINOR", issues=["dose"], summary=agent)
        if "tool" in schema.model_fields:
            return schema(tool="none" if schema is schemas.ToolCall else "search_literature", query="statins")
        return {
            schemas.Hypothesis: lambda: schemas.Hypothesis(hypothesis="h", rationale="r"),
            schemas.SupervisorChoice: lambda: schemas.SupervisorChoice(chosen=0, reason="r"),
            schemas.Protocol: lambda: schemas.Protocol(title="t", objective="o", methods=["m"], outcome_measures=["y"]),
        }[schema]()

    async def chat(self, agent, model, messages, spans, max_tokens=None, temperature=None, top_logprobs=None, prompt=None,
                   continue_from=None, stop=None, **_):
        """The PI's two calls (pipeline/agents/decision.py): the decision position's alternatives, then the rationale."""
        self.agents.append(agent)
        self.pi_calls.append({"messages": messages, "continue_from": continue_from, "top_logprobs": top_logprobs})
        data = {"agent": agent, "messages": [*messages, {"role": "assistant", "content": continue_from}], "ok": True}
        if top_logprobs:
            data["logprobs"] = [{"token": "GO", "top_logprobs": [{"token": "GO", "logprob": -0.2},
                                                                 {"token": "NO", "logprob": -1.8}]}]
        spans.append({"kind": "llm", "name": agent, "data": data})
        return "" if top_logprobs else 'It holds."\n}'


@pytest.mark.parametrize("concurrent", [True, False])
def test_review_board_routes_by_the_worst_review_whether_concurrent_or_not(tmp_path: Path, concurrent: bool) -> None:
    """Concurrent reviews change when the two reviewers run, not what the society does: the same calls,
    the same CRITICAL -> refiner loop, both reviews of each round recorded before the round is routed."""
    import asyncio

    client = _ScriptedClient()
    society = Society(client=client, tools=Toolbox(tmp_path / "no-index"), rng=random.Random(0),  # type: ignore[arg-type]
                      cfg=section("agents", concurrent_reviews=concurrent, max_review_rounds=2, max_turns=40, epsilon=0.0))
    state = asyncio.run(society.compile().ainvoke({"task": {"question": "Do statins help?"}, "review_round": 0}))
    assert client.most_in_flight == (2 if concurrent else 1)
    assert [(r["round"], r["severity"]) for r in sorted(state["reviews"], key=lambda r: (r["round"], r["reviewer"]))] == [
        (0, "MINOR"), (0, "CRITICAL"), (1, "MINOR"), (1, "MINOR")]
    seniors = [a for a in client.agents if a in ("hypothesis_refiner", "protocol_designer", "principal_investigator")]
    assert seniors == ["hypothesis_refiner", "protocol_designer", "hypothesis_refiner", "protocol_designer",
                       "principal_investigator", "principal_investigator"]  # the PI's decision, then its rationale
    assert state["decision"]["decision"] == "GO" and state["review_round"] == 2
    assert state["decision"]["rationale"] == "It holds."


@pytest.mark.parametrize("what", ["brief", "society"])
def test_the_society_pi_decides_on_the_call_role_level_evaluation_and_train_pi_make(tmp_path: Path, what: str) -> None:
    """The one decision path (#57): the society's PI asks its decision with the messages role-level evaluation and
    train_pi's rows use for the same brief (agents.decision.input brief), at the same prefix, read by the same rule;
    the rationale is written after it on the society's prompt (protocol and reviews), the decision fixed."""
    import asyncio

    from pipeline.agents import decision
    from pipeline.schemas import Decision

    cfg = section("agents", max_review_rounds=0, epsilon=0.0)
    cfg = cfg.model_copy(update={"decision": cfg.decision.model_copy(update={"input": decision.DecisionInput(what)})})
    client = _ScriptedClient()
    task = {"id": "1", "question": "Do statins help?", "contexts": ["An abstract."], "long_answer": "They do.",
            "setting": "reasoning_free"}
    society = Society(client=client, tools=Toolbox(tmp_path / "no-index"), rng=random.Random(0),  # type: ignore[arg-type]
                      cfg=cfg)
    state = asyncio.run(society.compile().ainvoke({"task": task, "review_round": 0}))
    decide, explain = client.pi_calls
    assert decide["continue_from"] == cfg.decision.prefix and decide["top_logprobs"]
    role_level_call = decision.decision_messages(task, cfg, "reasoning_free", REPOSITORY)  # what role_level.decide sends
    society_call = decision.decision_messages(task, cfg, "reasoning_free", REPOSITORY, state["protocol"], state["reviews"],
                                              what=decision.DecisionInput.SOCIETY)
    assert (decide["messages"] == role_level_call) is (what == "brief")
    assert "Protocol: none yet" in role_level_call[0]["content"] and "Protocol: {'title'" in society_call[0]["content"]
    assert explain["messages"] == society_call and explain["continue_from"] == decision.rationale_prefix(
        cfg.decision.prefix, Decision.GO)
    made, p_go, _ = decision.read([{"token": "GO", "logprob": -0.2}, {"token": "NO", "logprob": -1.8}])
    assert state["decision"]["decision"] == made.value and state["decision"]["p_go"] == pytest.approx(p_go)


def test_judge_samples_with_its_own_penalty_not_the_societys() -> None:
    """The society's frequency penalty is a lever on the agents; the judge is the instrument that compares
    them, so its requests carry judge.frequency_penalty (default none) whatever the agents use."""
    import asyncio

    import httpx

    from pipeline.agents.llm import RoleClient
    from pipeline.rewards.judge import judge

    bodies: list[dict] = []
    scores = json.dumps({**{k: 8 for k in ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency")}, "reason": "r"})

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        content = scores if body["model"] == "judge" else '{"hypothesis": "h", "rationale": "r"}'
        return httpx.Response(200, json={"choices": [{"message": {"content": content}, "finish_reason": "stop"}], "usage": {}})

    params = load_params(ROOT / "params.yaml", environ={})
    client = RoleClient.for_agents(params.agents.model_copy(update={"frequency_penalty": 0.5}), "http://proxy/v1", "k", 30)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    spans: list[dict] = []
    asyncio.run(client.chat("junior_1", "junior_researcher", [{"role": "user", "content": "q"}], spans))
    res = asyncio.run(judge(client, params.judge, params.reward, {"question": "q", "contexts": ["a"]}, {"protocol": "p"}, 3, spans))
    assert res["reason"] == "ok"
    assert [(b["model"], b.get("frequency_penalty")) for b in bodies] == [("junior_researcher", 0.5), ("judge", None)]
    assert [s["data"]["frequency_penalty"] for s in spans if s["kind"] == "llm"] == [0.5, 0.0]  # the trace says what was sent
    # the judge samples at its own temperature (0), the agents at theirs
    assert [b["temperature"] for b in bodies] == [params.agents.temperature, params.judge.temperature] and params.judge.temperature == 0


def test_judge_scores_are_the_expected_digit_under_the_models_distribution() -> None:
    """G-Eval: the score is the probability-weighted digit at the token that writes it, not the argmax."""
    import math

    from pipeline.rewards.judge import expected_scores

    def tok(text: str, alts: dict[str, float] | None = None) -> dict:
        return {"token": text, "logprob": 0.0, "top_logprobs": [{"token": t, "logprob": math.log(p)} for t, p in (alts or {}).items()]}

    tokens = [tok('{"'), tok("nov"), tok("elty"), tok('":'), tok(" "), tok("0", {"0": 0.5, "9": 0.25, ",": 0.25}), tok(","),
              tok(' "'), tok("clarity"), tok('":'), tok(" "), tok("4", {"4": 0.6, "5": 0.2, "x": 0.2}), tok(","),
              tok(' "reason": "'), tok("3"), tok('"}')]
    got = expected_scores(tokens)
    assert set(got) == {"novelty", "clarity"}  # a digit inside the reason string is no score
    assert got["novelty"] == pytest.approx((0 * 0.5 + 9 * 0.25) / 0.75 / 9)
    assert got["clarity"] == pytest.approx((4 * 0.6 + 5 * 0.2) / 0.8 / 9)
    assert expected_scores([tok('{"impact":'), tok("7")]) == {"impact": pytest.approx(7 / 9)}  # no alternatives: the digit itself


def test_a_role_naming_an_agent_the_graph_does_not_have_is_refused() -> None:
    """#56: a `roles:` entry naming an agent the graph lacks (a misspelling) loaded and answered nothing; the society
    refuses it when it is built, naming the agents it has."""
    models = {**section("agents").models, "principal_investgator": "principal_investigator"}
    with pytest.raises(ValueError, match=r"agents \['principal_investgator'\] are not agents of the graph"):
        Society(client=None, tools=None, cfg=section("agents", models=models), rng=random.Random(0))  # type: ignore[arg-type]


def test_a_dropped_connection_is_retried_as_often_as_params_say_then_the_call_fails() -> None:
    """agents.transport_retries bounds the retries of a call whose connection failed; a connection that comes back
    within them answers the call."""
    import asyncio

    import httpx

    from pipeline.agents.llm import LLMError, RoleClient

    attempts: list[int] = []

    def down_for(n: int):
        def answer(request: httpx.Request) -> httpx.Response:
            attempts.append(1)
            if len(attempts) <= n:
                raise httpx.ConnectError("nothing listens", request=request)
            return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}})
        return answer

    agents = load_params(ROOT / "params.yaml", environ={}).agents.model_copy(update={"transport_retries": 1, "transport_backoff_s": 0.0})
    messages = [{"role": "user", "content": "q"}]
    for down, answered in ((1, True), (2, False)):
        attempts.clear()
        client = RoleClient.for_agents(agents, "http://proxy/v1", "k", 30)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(down_for(down)))
        if answered:
            assert asyncio.run(client.chat("junior_1", "junior_researcher", messages, [])) == "ok"
        else:
            with pytest.raises(LLMError, match="ConnectError"):
                asyncio.run(client.chat("junior_1", "junior_researcher", messages, []))
        assert len(attempts) == 2  # the call and its one retry
