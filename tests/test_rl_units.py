"""Online RL pieces that need no model: completion rewards, the agent's inputs, the trace store and
its hooks, the verl config generated from params (fast)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config import load_params
from pipeline.rewards import completion
from pipeline.rl import store
from pipeline.rl.agent import GatewayClient, final_reward, parse_task
from pipeline.rl.verl_config import agentlightning_section, overrides
from pipeline.traces.schema import Span, Trace
from tests.conftest import ROOT

TASK = {"id": "1", "question": "Does X help?", "contexts": ["An abstract."], "final_decision": "yes"}


@pytest.fixture
def params():
    return load_params(ROOT / "params.yaml", environ={})


def test_parse_grades_schema_validity() -> None:
    ok = '```json\n{"decision": "GO", "rationale": "strong evidence"}\n```'
    assert completion.parse("PIDecision", ok)[0] == 1.0
    validity, obj, why = completion.parse("PIDecision", '{"decision": "MAYBE", "rationale": "x"}')
    assert validity == 0.5 and obj == {"decision": "MAYBE", "rationale": "x"} and "not a valid PIDecision" in why
    assert completion.parse("Protocol", "Here is a protocol: step one...")[0:3:2] == (
        0.0, "malformed: no JSON object in the completion (0/5 Protocol fields named)")
    cut = completion.parse("PIDecision", '{"decision": "GO", "rati')  # truncated at the token cap
    assert cut[0] == 0.25 and cut[1] is None and cut[2].startswith("malformed") and "1/2 PIDecision fields" in cut[2]
    assert completion.completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "ab"


def _client(port: int) -> completion.RoleClient:
    return completion.RoleClient(f"http://127.0.0.1:{port}/v1", "k", json_retries=0, timeout_s=30)


def test_malformed_completion_scores_low_without_calling_the_judge(params) -> None:
    # port 9 (discard) is never listened on here: any judge call would fail loudly in the reason
    out = asyncio.run(completion.score(_client(9), params.ppo.reward, params.judge, params.reward, "protocol_designer", "Protocol",
                                   "no json at all", TASK))
    assert out["value"] == 0.0 and out["judge"] is None and out["reason"].startswith("malformed")
    out = asyncio.run(completion.score(_client(9), params.ppo.reward, params.judge, params.reward, "principal_investigator", "PIDecision",
                                   'Sure! {"decision": "GO", "rat', TASK))
    assert out["value"] == pytest.approx(params.ppo.reward.validity * 0.25) and out["judge"] is None


def test_a_gold_only_reward_scores_the_decision_without_a_judge(params) -> None:
    """judge weight 0 (benchmarks/bench_before_after.py): the decision against the label is the whole signal, and
    no judge call is spent (the client points at the discard port: a call would show as a failure reason)."""
    w = params.ppo.reward.model_copy(update={"judge": 0.0})
    right = asyncio.run(completion.score(_client(9), w, params.judge, params.reward, "principal_investigator", "PIDecision",
                                     '{"decision": "GO", "rationale": "r"}', TASK))  # TASK's label is yes
    wrong = asyncio.run(completion.score(_client(9), w, params.judge, params.reward, "principal_investigator", "PIDecision",
                                     '{"decision": "NO-GO", "rationale": "r"}', TASK))
    assert right["judge"] is None and "judge: weight 0, not called" in right["reason"]
    assert right["value"] == pytest.approx(w.validity + w.alignment) and wrong["value"] == pytest.approx(w.validity)
    assert right["aligned"] is True and wrong["aligned"] is False


def test_judge_failure_and_timeout_are_low_rewards_with_reasons(params) -> None:
    valid = '{"decision": "GO", "rationale": "r"}'
    with socket.socket() as s:  # a closed port: the judge call fails
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    out = asyncio.run(completion.score(_client(dead), params.ppo.reward, params.judge, params.reward, "principal_investigator", "PIDecision",
                                   valid, TASK))
    w = params.ppo.reward
    assert out["judge"] == params.judge.failure_score and "judge call failed" in out["reason"]
    assert out["value"] == pytest.approx(w.validity * 1.0 + w.alignment * 1.0)  # GO agrees with the 'yes' label
    # a judge that accepts the connection and never answers: the reward's own timeout
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns: list[socket.socket] = []
    threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True).start()
    slow = params.model_copy(update={"ppo": params.ppo.model_copy(update={"reward": w.model_copy(update={"timeout_s": 0.5})})})
    out = asyncio.run(completion.score(_client(srv.getsockname()[1]), slow.ppo.reward, slow.judge, slow.reward,
                                   "hypothesis_refiner", "Hypothesis",
                                   '{"hypothesis": "h", "rationale": "r", "evidence_pmids": []}', TASK))
    srv.close()
    assert out["reason"].endswith("judge: judge timed out after 0.5s")
    assert out["value"] == pytest.approx(w.validity * 1.0 + w.judge * params.judge.failure_score)


def test_agent_reads_its_task_and_routes_only_the_trained_role_to_the_gateway() -> None:
    assert parse_task(json.dumps({"task": TASK}))["id"] == "1"
    assert parse_task(json.dumps({"data_id": "1", "task_json": json.dumps(TASK)}))["question"] == "Does X help?"
    with pytest.raises(ValueError, match="PUBMEDQA_TASK"):
        parse_task(json.dumps({"prompt": "hi"}))
    client = GatewayClient("http://proxy/v1", "pk", gateway_url="http://gw/proxy/rollout/r/attempt/0/mode/train/openai/v1/", gateway_key="gk",
                           trained=("senior_researcher",))
    assert client.endpoint("senior_researcher") == ("http://gw/proxy/rollout/r/attempt/0/mode/train/openai/v1", {"Authorization": "Bearer gk"})
    assert client.endpoint("junior_researcher") == ("http://proxy/v1", None)
    asyncio.run(client.aclose())


def test_final_reward_of_a_failed_rollout_is_low_with_its_reason() -> None:
    ids = {"run_id": "r", "shard": 0, "task_id": "1", "rollout_id": "x"}
    failed = Trace(**ids, status="failed", error="timed out after 90s")
    assert final_reward(failed, 0.0) == (0.0, "rollout failed: timed out after 90s")
    ok = Trace(**ids, status="ok", reward=0.6, spans=[Span(kind="reward", name="final", data={"value": 0.6, "reason": "good"})])
    assert final_reward(ok, 0.0) == (0.6, "judge: good")


EVENT = {"event_type": "model_request", "rollout_id": "r1", "attempt_id": "0", "timestamp": 1.0,
         "data": {"http_status": 200, "response": {"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": [4, 5]}]}}}


def test_hooks_never_overwrite_the_agents_record_and_record_failures(tmp_path: Path) -> None:
    from agentlightning.hooks import load_hooks
    from agentlightning.schemas import Event

    from pipeline.rl.gateway import HOOKS_FILE

    hooks = load_hooks(HOOKS_FILE)  # exactly how verl's trainer loads it
    hooks.trace_dir = tmp_path
    hooks.on_startup()
    rollout = SimpleNamespace(rollout_id="r1", input={"data_id": "1"}, status=SimpleNamespace(error_message=None))
    store.write(tmp_path, {"rollout_id": "r1", "written_by": "agent", "events": [EVENT], "reward": 0.4})
    hooks.on_succeeded(rollout, {"0": []}, None)
    assert store.read(tmp_path, "r1")["written_by"] == "agent" and store.read(tmp_path, "r1")["reward"] == 0.4
    reward = {**EVENT, "event_type": "reward", "data": {"value": 0.7}}
    other = SimpleNamespace(rollout_id="r2", input={}, status=SimpleNamespace(error_message=None))
    hooks.on_succeeded(other, {"0": [Event.model_validate({**EVENT, "rollout_id": "r2"}), Event.model_validate({**reward, "rollout_id": "r2"})]}, None)
    rec = store.read(tmp_path, "r2")
    assert rec["written_by"] == "hooks" and rec["reward"] == 0.7 and store.triplets(rec["events"]) == [
        {"prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5]}]
    killed = SimpleNamespace(rollout_id="r3", input={}, status=SimpleNamespace(error_message="local subprocess timed out"))
    hooks.on_failed(killed, None)
    assert store.read(tmp_path, "r3")["status"] == "failed" and store.read(tmp_path, "r3")["error"] == "local subprocess timed out"
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        store.records(tmp_path)


def test_verl_config_follows_params(params, tmp_path: Path) -> None:
    over = overrides(params.ppo, params.mlflow, tmp_path / "ckpt", "exp", params.serving.workers[0])
    cfg = params.ppo
    assert "algorithm.adv_estimator=grpo" in over and f"actor_rollout_ref.rollout.n={cfg.group_size}" in over
    assert f"actor_rollout_ref.model.lora_rank={cfg.lora.r}" in over and f"trainer.total_training_steps={cfg.max_steps}" in over
    assert not any(o.startswith("critic.") for o in over)
    gae = params.model_copy(update={"ppo": cfg.model_copy(update={"algorithm": "gae", "full_finetune": True, "verl_overrides": ["x.y=1"]})})
    over = overrides(gae.ppo, gae.mlflow, tmp_path / "ckpt", "exp", gae.serving.workers[0])
    assert "algorithm.adv_estimator=gae" in over and any(o.startswith("critic.model.path=") for o in over)
    assert not any("lora_rank" in o for o in over) and over[-1] == "x.y=1"
    section = agentlightning_section(params.ppo, params.judge, "http://gw", "k")
    assert Path(section["hooks"]).exists() and section["local"]["agent_class"] == "pipeline.rl.agent:SocietyAgent"
    assert section["trace_aggregator"]["level"] == "transition"


def test_the_gateway_forwards_calls_with_the_upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent Lightning 1.0.2's gateway forwards with only a content-type header; a keyed vLLM worker answers 401 to
    that. ``pipeline.rl.agl_server`` is its server with the key on the upstream client: exercised here on the real
    app (its lifespan, its ``_send_upstream_with_retries``) against a stub upstream that records what arrived."""
    import functools
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agentlightning.server import proxy as agl_proxy
    from fastapi.testclient import TestClient
    from omegaconf import OmegaConf

    from pipeline.rl import agl_server, gateway

    seen: list[dict[str, str]] = []

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers["content-length"]))
            seen.append({k.lower(): v for k, v in self.headers.items()})
            body = b'{"choices": []}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = OmegaConf.load(Path(agl_proxy.__file__).parents[1] / "config" / "server.yaml")
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    try:
        monkeypatch.setenv(gateway.UPSTREAM_KEY_ENV, "worker-key")
        app = agl_server.build(config)
        with TestClient(app) as tc:
            send = functools.partial(agl_proxy._send_upstream_with_retries, client=app.state.http_client, url=url, body={"a": 1})
            assert tc.portal.call(send).status_code == 200
        monkeypatch.delenv(gateway.UPSTREAM_KEY_ENV)
        plain = agl_server.build(config)  # no key configured: Agent Lightning's app unchanged
        with TestClient(plain) as tc:
            send = functools.partial(agl_proxy._send_upstream_with_retries, client=plain.state.http_client, url=url, body={})
            assert tc.portal.call(send).status_code == 200
    finally:
        server.shutdown()
    assert seen[0]["authorization"] == "Bearer worker-key" and seen[0]["content-type"] == "application/json"
    assert "authorization" not in seen[1]
