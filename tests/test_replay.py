"""Evaluation by replay: a candidate's society answers the unchanged roles' calls from the champion's record.

The model behind the client here is an HTTP handler that samples (an unseeded RNG in every answer), so two
societies run whole never agree by chance; what the replayed candidate shares with the champion can only
come from the record.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import REPOSITORY
from pipeline.agents.replay import ROLLOUT_ID, CallBook
from pipeline.agents.rollout import run_rollout
from pipeline.agents.tools import Toolbox
from pipeline.config import load_params
from tests.conftest import ROOT

TASK = {"id": "123", "question": "Do statins reduce mortality?", "contexts": ["Statins were given."], "final_decision": "yes"}


class SamplingModel:
    """Valid JSON for each schema the society asks for, with a fresh random draw in every answer; counts requests per logical model."""

    def __init__(self) -> None:
        self.rng = random.Random()  # unseeded: sampling noise
        self.requests: Counter[str] = Counter()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests[body["model"]] += 1
        draw = self.rng.random()
        if "response_format" not in body:  # the PI's decision position (alternatives listed), then its rationale
            top = [{"token": t, "logprob": -self.rng.random()} for t in ("GO", "NO")]
            choice: dict[str, Any] = {"message": {"content": "GO" if body.get("logprobs") else f'r{draw:.6f}"'},
                                      "finish_reason": "stop", "logprobs": {"content": [{"token": "GO", "top_logprobs": top}]}}
            return httpx.Response(200, json={"model": body["model"], "usage": {"total_tokens": 10}, "choices": [choice]},
                                  headers={"x-litellm-model-group": f"{body['model']}-base"})
        schema = body["response_format"]["json_schema"]["name"]
        answer: dict[str, Any] = {
            "EvidenceCall": {"tool": "search_literature", "query": f"statins {draw:.6f}"},
            "ToolCall": {"tool": "none", "query": ""},
            "Hypothesis": {"hypothesis": f"statins lower mortality ({draw:.6f})", "rationale": "trials", "evidence_pmids": []},
            "SupervisorChoice": {"chosen": self.rng.randrange(3), "reason": "r"},
            "Protocol": {"title": f"t{draw:.6f}", "objective": "o", "methods": ["m"], "controls": ["c"], "outcome_measures": ["y"]},
            "Review": {"severity": "MINOR", "issues": ["dose"], "summary": "ok"},
            "PIDecision": {"decision": self.rng.choice(["GO", "NO-GO"]), "rationale": f"r{draw:.6f}"},
        }[schema]
        payload = {"model": body["model"], "usage": {"total_tokens": 10},
                   "choices": [{"message": {"content": json.dumps(answer)}, "finish_reason": "stop"}]}
        return httpx.Response(200, json=payload, headers={"x-litellm-model-group": f"{body['model']}-base"})


def _rollout(tmp_path: Path, model: SamplingModel, book: CallBook | None = None) -> Any:
    params = load_params(ROOT / "params.yaml")
    client = RoleClient.for_agents(params.agents, "http://proxy.invalid/v1", "k", 30.0, replay=book)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(model))
    ids = {"run_id": "r", "shard": 0, "task_id": TASK["id"], "rollout_id": f"{TASK['id']}-0"}

    async def go() -> Any:
        try:
            return await run_rollout(params.agents, params.judge, params.reward, client, Toolbox(tmp_path / "no-index"), TASK, ids, 0,
                                     score=False)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _calls(trace: Any, *models: str) -> list[dict[str, Any]]:
    return [s.data for s in trace.spans if s.kind == "llm" and (not models or s.data["logical_model"] in models)]


def test_a_candidate_shares_the_champions_calls_up_to_its_role_and_samples_its_own(tmp_path: Path) -> None:
    champion_model = SamplingModel()
    champion = _rollout(tmp_path, champion_model)
    assert champion.status == "ok", champion.error

    candidate_model = SamplingModel()  # the candidate's senior_researcher: another model (another RNG)
    book = CallBook.from_traces([champion], live=["senior_researcher"])
    candidate = _rollout(tmp_path, candidate_model, book)
    assert candidate.status == "ok", candidate.error

    # everything before the senior's first call is the champion's, answer for answer, and cost no request
    before = ["junior_researcher", "supervisor"]
    assert [c["output"] for c in _calls(candidate, *before)] == [c["output"] for c in _calls(champion, *before)]
    assert all(c.get("replayed") for c in _calls(candidate, *before))
    assert candidate_model.requests["junior_researcher"] == 0 and candidate_model.requests["supervisor"] == 0
    assert candidate.spans and candidate.protocol is not None
    # the role under evaluation always runs: its calls were sent, none was answered from the record
    seniors = _calls(candidate, "senior_researcher")
    assert seniors and not any(c.get("replayed") for c in seniors)
    assert candidate_model.requests["senior_researcher"] == len(seniors)
    assert book.replayed == len(_calls(candidate, *before))
    # cheaper: the candidate sent only what its role changed
    assert sum(candidate_model.requests.values()) < sum(champion_model.requests.values())


def test_a_book_answers_only_the_rollout_it_was_recorded_in(tmp_path: Path) -> None:
    """Another task (another rollout id) with the same requests is sampled live: the record is per task."""
    champion = _rollout(tmp_path, SamplingModel())
    book = CallBook.from_traces([champion.model_copy(update={"rollout_id": "999-0"})], live=["senior_researcher"])
    model = SamplingModel()
    candidate = _rollout(tmp_path, model, book)
    assert book.replayed == 0 and not any(c.get("replayed") for c in _calls(candidate))
    assert model.requests["junior_researcher"] > 0


def test_without_replay_two_whole_runs_differ_by_sampling(tmp_path: Path) -> None:
    """The control for the first test: the junior answers agree only through the record, never by chance."""
    a, b = _rollout(tmp_path, SamplingModel()), _rollout(tmp_path, SamplingModel())
    assert [c["output"] for c in _calls(a, "junior_researcher")] != [c["output"] for c in _calls(b, "junior_researcher")]


def test_a_replaying_candidate_runs_each_task_beside_the_champion_and_every_shared_request_is_sent_once(
        tmp_path: Path, monkeypatch: Any) -> None:
    """evaluate's schedule (one event loop): a senior candidate runs each task beside the champion's rollout of it, not
    after it; each junior and supervisor request the two share is sent once, by whichever asked first, and the other
    waits for that draw. A junior candidate (nothing of the champion's before its calls) runs whole, at once."""
    import time

    from pipeline.evaluation import society
    from pipeline.serving import proxy

    log: list[tuple[float, str, str, str]] = []  # (time, society, question, logical model) of every request received
    model = SamplingModel()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        question = {"100-0": "slow", "101-0": "fast-a", "102-0": "fast-b"}[ROLLOUT_ID.get() or ""]  # the rollout this call is in
        log.append((time.perf_counter(), body["metadata"]["routing"], question, body["model"]))
        await asyncio.sleep(0.15 if question == "slow" else 0.01)
        return model(request)

    real = RoleClient.for_agents

    def mocked(*args: Any, **kwargs: Any) -> RoleClient:
        client = real(*args, **kwargs)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return client

    monkeypatch.setattr(society.RoleClient, "for_agents", mocked)
    monkeypatch.setattr(proxy, "client_settings", lambda serving: ("http://proxy.invalid/v1", "k"))
    params = load_params(ROOT / "params.yaml")
    params = params.model_copy(update={"rollouts": params.rollouts.model_copy(update={"index_dir": str(tmp_path / "no-index")}),
                                       "evaluate": params.evaluate.model_copy(update={"concurrency": 9})})
    tasks = [{**TASK, "id": str(100 + i), "question": f"Do statins reduce mortality ({q})?"} for i, q in enumerate(("slow", "fast-a", "fast-b"))]
    shared = CallBook()
    book = shared.sharing(live=["senior_researcher"])
    champion, senior, junior = society.run_many(params, tasks, [(None, "champion"), (None, "senior"), (None, "junior")], "r",
                                                REPOSITORY, score=False, description="schedule", books=[shared, book, None])
    assert all(t.status == "ok" for t in (*champion, *senior, *junior)), [t.error for t in (*champion, *senior, *junior)]

    def times(who: str, question: str) -> list[float]:
        return [t for t, s, q, _ in log if s == who and q == question]

    for q in ("slow", "fast-a", "fast-b"):  # each task: the candidate's own calls while the champion's rollout of it runs
        assert min(times("senior", q)) < max(times("champion", q)), q
    # the shared calls: the same answers, each request sent once between the two societies
    before = ["junior_researcher", "supervisor"]
    for c, s in zip(champion, senior, strict=True):  # (the juniors answer side by side: compared by request, not order)
        assert {x["request_key"]: x["output"] for x in _calls(s, *before)} == {x["request_key"]: x["output"] for x in _calls(c, *before)}
    sent = Counter(m for _, s, _, m in log if s in ("champion", "senior") and m in before)
    drawn = Counter(x["logical_model"] for t in champion for x in _calls(t, *before))
    assert sent == drawn, (sent, drawn)
    assert book.replayed + shared.replayed == sum(drawn.values())
    assert not any(c.get("replayed") for t in senior for c in _calls(t, "senior_researcher"))  # its own role: always sent
    assert not any(c.get("replayed") for t in junior for c in _calls(t))  # no book: whole


def test_a_retried_rollout_is_answered_from_the_start_of_the_record_again(tmp_path: Path) -> None:
    """run_with_retries runs the same rollout id again after a failed or timed-out attempt: the retry must replay
    the champion's calls too, not find them used up by the attempt that failed and run them live."""
    champion = _rollout(tmp_path, SamplingModel())
    book = CallBook.from_traces([champion], live=["senior_researcher"])
    before = ["junior_researcher", "supervisor"]
    for attempt in (1, 2):
        model = SamplingModel()
        retry = _rollout(tmp_path, model, book)
        assert [c["output"] for c in _calls(retry, *before)] == [c["output"] for c in _calls(champion, *before)], attempt
        assert model.requests["junior_researcher"] == 0 and model.requests["supervisor"] == 0, attempt


def test_a_call_that_asks_for_logprobs_is_never_answered_from_the_record() -> None:
    """The judge scores from the logprobs of its answer, which a recorded span does not keep. With seeded calls a
    candidate's judge request can equal the champion's byte for byte; answered from the record, it scored 0 on every
    task (seen in benchmarks/bench_learning.py). It is sent, and its span carries the logprobs."""
    sent: Counter[str] = Counter()

    def judge_model(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent[body["model"]] += 1
        token = {"token": "4", "logprob": -0.1, "top_logprobs": [{"token": "4", "logprob": -0.1}]}
        return httpx.Response(200, json={"model": body["model"], "usage": {"total_tokens": 3}, "choices": [
            {"message": {"content": '{"score": 4}'}, "finish_reason": "stop", "logprobs": {"content": [token]}}]})

    async def ask(book: CallBook | None) -> dict[str, Any]:
        client = RoleClient("http://proxy.invalid/v1", "k", max_tokens=8, temperature=0.0, timeout_s=5, replay=book)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(judge_model))
        spans: list[dict[str, Any]] = []
        try:
            await client.chat("judge", "judge", [{"role": "user", "content": "Score it."}], spans, top_logprobs=5)
        finally:
            await client.aclose()
        return spans[0]

    ROLLOUT_ID.set("123-0")
    recorded = asyncio.run(ask(None))
    recorded["data"].pop("logprobs")  # what the judge does before the span is kept
    book = CallBook.from_traces([{"rollout_id": "123-0", "spans": [recorded]}], live=["senior_researcher"])
    again = asyncio.run(ask(book))
    assert sent["judge"] == 2 and not again["data"].get("replayed") and again["data"]["logprobs"]
    assert book.replayed == 0
