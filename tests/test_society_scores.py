"""What evaluate records for a society's rollout in MLflow's GenAI evaluation: the judge's scores the rollout ended with,
and for a rollout that left none (failed, or timed out) the failure score with its decision credit; the test report
counts the same reward for it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline.agents.prompts import REPOSITORY
from pipeline.agents.rollout import failed_span, run_with_retries
from pipeline.agents.tools import Toolbox
from pipeline.config import load_params
from pipeline.rewards.judge import CRITERIA, final_reward, final_span
from pipeline.stages import evaluate
from pipeline.traces.schema import Span, Trace
from tests.conftest import ROOT

IDS = {"run_id": "r", "shard": 0, "task_id": "1"}


def _scores(params: Any, trace: Trace) -> dict[str, Any]:
    judge_scorer = evaluate._scorers(params, {trace.rollout_id: trace})[0]
    return {f.name: (f.value, f.rationale) for f in judge_scorer(inputs={"rollout_id": trace.rollout_id})}


class _Hanging:
    """A serving plane that never answers: every rollout runs into its timeout."""

    replay = None
    prompts = REPOSITORY

    async def structured(self, *_: Any, **__: Any) -> None:
        await asyncio.sleep(60)

    async def chat(self, *_: Any, **__: Any) -> None:
        await asyncio.sleep(60)


def _timed_out(params: Any, tmp_path: Path) -> Trace:
    """What run_with_retries returns for a scored rollout that timed out."""
    task = {"id": "1", "question": "Do statins help?", "contexts": ["An abstract."], "final_decision": "yes"}
    return asyncio.run(run_with_retries(params.agents, params.judge, params.reward, _Hanging(), Toolbox(tmp_path / "no-index"),  # type: ignore[arg-type]
                                        task, {**IDS, "rollout_id": "1-1"}, 0, 3, None, timeout_s=0.2, retries=0))


def test_a_judged_rollout_is_recorded_with_its_judges_scores_and_a_timed_out_one_with_the_failure_score(tmp_path: Path) -> None:
    params = load_params(ROOT / "params.yaml", environ={})
    value, parts = final_reward(0.75, "GO", "yes", params.reward)
    judged = [Span(kind="reward", name=f"judge.{c}", seq=i, data={"value": 0.75, "kind": "judge", "reason": "ok"})
              for i, c in enumerate(CRITERIA)]
    final = final_span(value, parts, "sound protocol")
    ok = Trace(**IDS, rollout_id="1-0", label="yes", status="ok", decision="GO", reward=value, rewards={c: 0.75 for c in CRITERIA},
               spans=[*judged, Span(kind=final["kind"], name=final["name"], seq=len(judged), data=final["data"])])
    got = _scores(params, ok)
    assert got["reward"] == (pytest.approx(value), "ok") and all(got[c][0] == 0.75 for c in CRITERIA)
    assert {k: got[f"reward_{k}"][0] for k in parts} == pytest.approx(parts)

    timed_out = _timed_out(params, tmp_path)
    assert timed_out.status == "failed" and timed_out.error == "timed out after 0s" and timed_out.label == "yes"
    assert timed_out.routing_version == 3  # what it was run under, as a finished rollout says
    got = _scores(params, timed_out)
    fail, fail_parts = final_reward(params.judge.failure_score, None, "yes", params.reward)
    assert got["reward"] == (pytest.approx(fail), "rollout failed, not judged: timed out after 0s")
    assert all(got[c][0] == params.judge.failure_score for c in CRITERIA)
    assert {k: got[f"reward_{k}"][0] for k in fail_parts} == pytest.approx(fail_parts)


def test_the_test_report_counts_a_failed_rollouts_reward_as_evaluation_does(tmp_path: Path) -> None:
    """A rollout that failed after its PI decided (the protocol missing) earns the failure score with its decision credit
    in `evaluate`; the test report's society figure counts the same reward for it, not 0, and a rollout that timed out
    counts against the yes/no accuracy as a failure (#57: one reading)."""
    from pipeline.stages import report

    params = load_params(ROOT / "params.yaml", environ={})
    span = failed_span(params.judge, params.reward, "GO", "yes", "society produced no protocol/decision")
    failed = Trace(**IDS, rollout_id="1-0", label="yes", status="failed", error="no protocol", decision="GO",
                   spans=[Span(**span)])
    timed_out = _timed_out(params, tmp_path)
    value = span["data"]["value"]
    assert value > 0  # the decision's credit: what a reader of `t.reward or 0.0` lost
    figures, records = report._society_figures([failed, timed_out], params.evaluate, params.data.setting)
    assert [r["reward"] for r in records] == pytest.approx([_scores(params, t)["reward"][0] for t in (failed, timed_out)])
    assert records[0]["reward"] == pytest.approx(value)
    assert figures.yes_no and figures.yes_no.n == 2  # the timed-out rollout's question is counted (wrong), not dropped
