"""The agent entry point the Agent Lightning controller runs, once per rollout (``pipeline.rl.agent:SocietyAgent``).

The controller starts a subprocess with ``AGL_OPENAI_BASE_URL`` (the gateway's per-rollout OpenAI
base URL), ``AGL_EVENT_URL`` and ``AGL_KEY``, plus ``PUBMEDQA_TASK`` (the rollout's input as JSON,
through the rollout config's ``env_map``). It runs the same LangGraph society as every other stage:

- only calls for the roles being trained (``senior_researcher``: refiner and designer; the PI is its own role) go through
  the gateway, which records prompt/response token ids for the trainer; every other role, and the
  judge, stays on the proxy's live champions. Nothing streams.
- intermediate rewards (each structured output's validity, the judge's criteria) are posted as
  ``society_reward`` events, the final reward as the one ``reward`` event, with its reason; a failed
  or timed-out society still posts a (low) reward with the reason, so the trainer never waits on it.
- before exiting it writes our trace line and the gateway's events for this rollout to the RL trace
  store (``pipeline/rl/store.py``): a finished rollout survives the gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

import httpx

from pipeline import prompt_registry, tracking
from pipeline.agents.llm import RoleClient
from pipeline.agents.rollout import run_with_retries, supervisor_policy
from pipeline.agents.tools import Toolbox
from pipeline.config import load_params
from pipeline.learning import Learning
from pipeline.rl import store
from pipeline.rl.store import ROLE_ENV, RUN_ENV, TRACE_DIR_ENV
from pipeline.serving import routing
from pipeline.serving.routing import society_endpoint

TASK_ENV = "PUBMEDQA_TASK"
_EVENT_URL = re.compile(r"^(?P<base>.*)/api/rollouts/(?P<rollout>[^/]+)/attempt/(?P<attempt>[^/]+)/events/?$")


class GatewayClient(RoleClient):
    """The proxy for every role except the trained ones, which go to the gateway (the policy being trained)."""

    def __init__(self, *args: Any, gateway_url: str, gateway_key: str, trained: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gateway_url = gateway_url.rstrip("/")
        self.gateway_headers = {"Authorization": f"Bearer {gateway_key}"} if gateway_key else {"Authorization": ""}
        self.trained = set(trained)

    def endpoint(self, model: str) -> tuple[str, dict[str, str] | None]:
        if model in self.trained:
            return self.gateway_url, self.gateway_headers
        return self.base_url, None


def parse_task(raw: str) -> dict[str, Any]:
    """The rollout input: ``{"task": {...}}``, ``{"task_json": "..."}`` (verl rows) or the task itself."""
    value = json.loads(raw)
    if isinstance(value, dict) and "task_json" in value:
        value = json.loads(value["task_json"])
    elif isinstance(value, dict) and isinstance(value.get("task"), dict):
        value = value["task"]
    if not isinstance(value, dict) or "question" not in value or "id" not in value:
        raise ValueError(f"{TASK_ENV}: expected a PubMedQA task with 'id' and 'question', got {raw[:200]!r}")
    return value


def final_reward(trace: Any, failure_score: float) -> tuple[float, str]:
    if trace.status != "ok":
        return failure_score, f"rollout failed: {trace.error}"
    if trace.reward is None:
        return failure_score, "not judged"
    return float(trace.reward), f"judge: {trace.final()['reason']}"[:300]


class SocietyAgent:
    async def run(self) -> None:
        event_url = os.environ["AGL_EVENT_URL"]
        m = _EVENT_URL.match(event_url)
        if m is None:
            raise ValueError(f"AGL_EVENT_URL {event_url!r} is not <base>/api/rollouts/<id>/attempt/<id>/events")
        key = os.environ.get("AGL_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        params = load_params()
        task = parse_task(os.environ[TASK_ENV])
        rollout_id = m["rollout"]
        base_url, proxy_key, version = society_endpoint(params.rollouts, params.serving)
        cfg = params.rollouts
        # the role train_ppo@<role> trains (its driver says so), else every role that learns by RL (ppo.roles)
        trained = (os.environ[ROLE_ENV],) if os.environ.get(ROLE_ENV) else tuple(params.learners()[Learning.PPO])
        table = routing.active(params.serving) if not params.rollouts.llm_base_url else None
        if (table or {}).get("prompts"):
            tracking.setup(params.mlflow)
        # the routed prompt versions, as the rollouts stage renders them: a policy trained on other prompts than the
        # society serves would be gated on prompts it never saw
        client = GatewayClient.for_agents(params.agents, base_url, proxy_key, cfg.timeout_s,
                                          prompts=prompt_registry.routed(table), gateway_url=os.environ["AGL_OPENAI_BASE_URL"],
                                          gateway_key=key, trained=trained)
        tools = Toolbox(cfg.index_dir, params.agents.search_top_k)
        policy = supervisor_policy(params.agents, params.mlflow, table)
        ids = {"run_id": os.environ.get(RUN_ENV, "agl"), "shard": 0, "task_id": str(task["id"]), "rollout_id": rollout_id}
        try:
            trace = await run_with_retries(params.agents, params.judge, params.reward, client, tools, task, ids, cfg.seed,
                                           version, policy, params.ppo.agl.rollout_timeout_s * 0.9, 0)
        finally:
            await client.aclose()
        reward, reason = final_reward(trace, params.judge.failure_score)
        async with httpx.AsyncClient(headers=headers, timeout=60) as http:
            for span in trace.spans:
                if span.kind == "reward" and span.name != "final":
                    event = {"event_type": "society_reward", "data": {"name": span.name, **span.data}}
                    (await http.post(event_url, json=event)).raise_for_status()
            event = {"event_type": "reward", "data": {"value": reward, "source": "agent", "reason": reason}}
            (await http.post(event_url, json=event)).raise_for_status()
            events = (await http.get(f"{m['base']}/api/rollouts/{rollout_id}/events")).raise_for_status().json()
        store.write(os.environ.get(TRACE_DIR_ENV) or params.ppo.agl.trace_dir,
                    {"rollout_id": rollout_id, "run_id": ids["run_id"], "task_id": str(task["id"]),
                     "status": "succeeded" if trace.status == "ok" else "failed",
                     "reward": reward, "reason": reason, "trace": trace.model_dump(mode="json"), "events": events,
                     "triplets": len(store.triplets(events)), "written_by": "agent", "persisted_at": time.time()})


if __name__ == "__main__":  # a Kubernetes Job of the k8s runner (infra/k8s/templates/agl-rollout-job.yaml.j2) runs this
    asyncio.run(SocietyAgent().run())
