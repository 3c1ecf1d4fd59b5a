"""What evaluate records for a society's rollout in MLflow's GenAI evaluation: the judge's scores the rollout ended with,
and for a rollout that left none (failed, or timed out with no spans) the failure score with its decision credit."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import load_params
from pipeline.rewards.judge import CRITERIA, final_reward, final_span
from pipeline.stages import evaluate
from pipeline.traces.schema import Span, Trace
from tests.conftest import ROOT


def _scores(params: Any, trace: Trace) -> dict[str, Any]:
    judge_scorer = evaluate._scorers(params, {trace.rollout_id: trace})[0]
    return {f.name: (f.value, f.rationale) for f in judge_scorer(inputs={"rollout_id": trace.rollout_id})}


def test_a_judged_rollout_is_recorded_with_its_judges_scores_and_a_timed_out_one_with_the_failure_score() -> None:
    params = load_params(ROOT / "params.yaml", environ={})
    ids = {"run_id": "r", "shard": 0, "task_id": "1", "rollout_id": "1-0", "label": "yes"}
    value, parts = final_reward(0.75, "GO", "yes", params.reward)
    judged = [Span(kind="reward", name=f"judge.{c}", seq=i, data={"value": 0.75, "kind": "judge", "reason": "ok"})
              for i, c in enumerate(CRITERIA)]
    final = final_span(value, parts, "sound protocol")
    ok = Trace(**ids, status="ok", decision="GO", reward=value, rewards={c: 0.75 for c in CRITERIA},
               spans=[*judged, Span(kind=final["kind"], name=final["name"], seq=len(judged), data=final["data"])])
    got = _scores(params, ok)
    assert got["reward"] == (pytest.approx(value), "ok") and all(got[c][0] == 0.75 for c in CRITERIA)
    assert {k: got[f"reward_{k}"][0] for k in parts} == pytest.approx(parts)

    timed_out = Trace(**ids, status="failed", error="timed out after 600s")  # what run_with_retries returns: no spans
    got = _scores(params, timed_out)
    fail, fail_parts = final_reward(params.judge.failure_score, None, "yes", params.reward)
    assert got["reward"] == (pytest.approx(fail), "rollout failed: timed out after 600s")
    assert all(got[c][0] == params.judge.failure_score for c in CRITERIA)
    assert {k: got[f"reward_{k}"][0] for k in fail_parts} == pytest.approx(fail_parts)


def test_the_test_report_counts_a_failed_rollouts_reward_as_evaluation_does() -> None:
    """A rollout that failed after its PI decided (the protocol missing) earns the failure score with its decision credit
    in `evaluate`; the test report's society figure counts the same reward for it, not 0 (#57: one reading)."""
    from pipeline.stages import report

    params = load_params(ROOT / "params.yaml", environ={})
    ids = {"run_id": "r", "shard": 0, "task_id": "1", "label": "yes"}
    value, parts = final_reward(params.judge.failure_score, "GO", "yes", params.reward)
    final = final_span(value, parts, "rollout failed, not judged: society produced no protocol/decision")
    failed = Trace(**ids, rollout_id="1-0", status="failed", error="no protocol", decision="GO",
                   spans=[Span(kind=final["kind"], name=final["name"], data=final["data"])])
    timed_out = Trace(**ids, rollout_id="1-1", status="failed", error="timed out after 600s")
    assert value > 0  # the decision's credit: what a reader of `t.reward or 0.0` lost
    _, records = report._society_figures([failed, timed_out], params)
    assert [r["reward"] for r in records] == pytest.approx([_scores(params, t)["reward"][0] for t in (failed, timed_out)])
    assert records[0]["reward"] == pytest.approx(value)
