"""The few-shot prompt optimizer's rules (#43), without services: what a candidate looks like, which questions it may
use, and when it hands MLflow a prompt to register. Its run against the served PI: tests/test_promotion_integration.py."""

from __future__ import annotations

from typing import Any

import pytest
from mlflow.genai.optimize.types import EvaluationResultRecord

from pipeline.agents import prompts
from pipeline.prompt_optimizer import FewShotOptimizer, fields, record, split, with_demos
from tests.conftest import section

PI = "principal_investigator"


def _tasks(n: int) -> list[dict[str, Any]]:
    labels = ["yes", "no", "maybe"]
    return [{"id": str(1000 + i), "question": f"Does {{x}} {i} help?", "contexts": ["c"], "long_answer": f"It {i}.",
             "final_decision": labels[i % 3]} for i in range(n)]


def test_a_candidate_keeps_the_templates_fields_and_shows_balanced_gold_decisions() -> None:
    pool, dev = split(_tasks(60), 8, seed=0)
    assert len(dev) == 8 and not {t["id"] for t in pool} & {t["id"] for t in dev}  # a demonstration never scores itself
    assert all(t["final_decision"] in ("yes", "no") for t in pool + dev)  # maybe has no right decision
    assert split(_tasks(60), 8, seed=0) == (pool, dev) != split(_tasks(60), 8, seed=1)
    prefix = section("agents").decision.prefix
    opt = FewShotOptimizer(section("prompt").model_copy(update={"demos": 4}), pool, "reasoning_free", prefix)
    demos = opt._demos(0)
    assert sorted(t["final_decision"] for t in demos) == ["no", "no", "yes", "yes"]
    text = with_demos(prompts.TEMPLATES[PI], demos, "reasoning_free", prefix)
    assert fields(text) == fields(prompts.TEMPLATES[PI])  # the question's braces are escaped
    rendered = text.format(brief="B", protocol="P", reviews="none")
    assert "Does {x}" in rendered and "Conclusion: It" in rendered
    assert rendered.count(prefix + 'GO"') == 2 and rendered.count(prefix + 'NO-GO"') == 2  # written as the PI writes it


def _eval_fn(answers: dict[str, dict[str, str]]) -> Any:
    """MLflow's eval function's contract: candidate template -> one record per dev question, scored 0/1."""
    def run(candidates: dict[str, str], data: list[dict[str, Any]]) -> list[EvaluationResultRecord]:
        (text,) = candidates.values()
        key = "demos" if text.startswith("Earlier") else "current"
        out = []
        for d in data:
            decision = answers[key][d["inputs"]["task_id"]]
            out.append(EvaluationResultRecord(inputs=d["inputs"], outputs={"decision": decision, "p_go": 0.5},
                                              expectations=d["expectations"], trace=None, rationales={},
                                              score=float(decision == d["expectations"]["decision"])))
        return out
    return run


@pytest.mark.parametrize(("flip", "status"), [(0, "no_signal"), (-1, "no_gain"), (1, "trained")])
def test_only_a_candidate_that_beat_the_current_prompt_is_handed_to_mlflow(flip: int, status: str) -> None:
    """no_signal: no demonstration changed a decision; no_gain: they changed some, none for the better; trained: the
    winner is returned (``optimize_prompts`` registers what is returned, and nothing when nothing is)."""
    pool, dev = split(_tasks(60), 8, seed=0)
    data = [record(t) for t in dev]
    gold = {d["inputs"]["task_id"]: d["expectations"]["decision"] for d in data}
    wrong = {"GO": "NO-GO", "NO-GO": "GO"}
    current = {k: (wrong[v] if i % 2 else v) for i, (k, v) in enumerate(gold.items())}  # half right
    changed = dict(current)
    first_wrong = next(k for k in current if current[k] != gold[k])
    first_right = next(k for k in current if current[k] == gold[k])
    if flip == 1:
        changed[first_wrong] = gold[first_wrong]
    elif flip == -1:
        changed[first_right] = wrong[gold[first_right]]
    cfg = section("prompt").model_copy(update={"candidates": 2, "demos": 2, "max_calls": 1000})
    opt = FewShotOptimizer(cfg, pool, "reasoning_required", "{")
    out = opt.optimize(_eval_fn({"current": current, "demos": changed}), data, {"society." + PI: prompts.TEMPLATES[PI]})
    assert opt.status == status and opt.calls == 3 * len(data)
    assert bool(out.optimized_prompts) == (status == "trained")
    assert out.initial_eval_score == pytest.approx(0.5)
    if status == "trained":
        assert out.final_eval_score == pytest.approx(0.5 + 1 / len(data))
        assert out.optimized_prompts["society." + PI].endswith(prompts.TEMPLATES[PI])


def test_the_budget_stops_candidates_before_they_start() -> None:
    pool, dev = split(_tasks(60), 8, seed=0)
    data = [record(t) for t in dev]
    same = {d["inputs"]["task_id"]: "GO" for d in data}
    cfg = section("prompt").model_copy(update={"candidates": 5, "max_calls": 3 * len(data)})
    opt = FewShotOptimizer(cfg, pool, "reasoning_required", "{")
    opt.optimize(_eval_fn({"current": same, "demos": same}), data, {"society." + PI: prompts.TEMPLATES[PI]})
    assert opt.calls == 3 * len(data) and len(opt.scored) == 3  # the current prompt and two candidates, no more
