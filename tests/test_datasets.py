"""Trace -> dataset adapters and the datasets stage, on synthetic traces (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_params
from pipeline.lineage import dvc_md5
from pipeline.stages import datasets
from tests.conftest import set_param

SYSTEM = {"role": "system", "content": "You are a geneticist."}


def llm(agent: str, model: str, output: str, attempt: int = 1, parsed: bool = True, user: str = "go",
        schema: str | None = "Hypothesis") -> dict:
    return {"kind": "llm", "name": agent, "data": {"agent": agent, "logical_model": model, "messages": [SYSTEM, {"role": "user", "content": user}],
                                                   "output": output, "ok": True, "attempt": attempt, "parsed": parsed,
                                                   "schema": schema}}


def trace(task: str, k: int, reward: float | None, status: str = "ok", decision: bool = True) -> dict:
    spans = [llm("geneticist", "junior_researcher", '{"tool": "none", "query": ""}'),
             llm("geneticist", "junior_researcher", "{bad", attempt=1, parsed=False, user="hyp"),
             llm("geneticist", "junior_researcher", '{"hypothesis": "h"}', attempt=2, user="hyp"),
             llm("neurologist", "junior_researcher", '{"hypothesis": "n"}', user="hyp2"),
             llm("hypothesis_refiner", "senior_researcher", '{"hypothesis": "r"}', user="refine"),
             llm("protocol_designer", "senior_researcher", '{"title": "t"}', user="design", schema="Protocol"),
             llm("peer_reviewer", "review_board", '{"severity": "MINOR"}', user="review", schema="Review"),
             llm("principal_investigator", "principal_investigator", "GO", user="decide", schema=None)]
    if decision:
        cands = [{"author": "geneticist", "hypothesis": "gene x", "rationale": "r", "evidence_pmids": ["1"]},
                 {"author": "neurologist", "hypothesis": "brain y", "rationale": "r", "evidence_pmids": []}]
        spans.append({"kind": "decision", "name": "supervisor", "data": {
            "candidates": ["geneticist", "neurologist"], "candidate_hypotheses": cands, "context": "Does gene x matter?",
            "model_choice": 1, "chosen": 1, "propensity": 0.95, "epsilon": 0.1, "policy": "llm", "pmf": [0.05, 0.95]}})
    return {"run_id": "run-a", "shard": 0, "task_id": task, "rollout_id": f"{task}-{k}", "status": status, "reward": reward,
            "label": "yes", "error": None if status == "ok" else "boom", "spans": [dict(s, seq=i) for i, s in enumerate(spans)]}


@pytest.fixture
def traced(project: Path) -> Path:
    """A scratch project with a tiny train split and a shard of synthetic traces."""
    (project / "data/validated").mkdir(parents=True)
    pd.DataFrame([{"id": t, "question": f"q {t}?", "contexts": ["abstract", t], "final_decision": "yes"} for t in ("1", "2", "3")]
                 ).to_parquet(project / "data/validated/train.parquet")
    shard = project / "data/rollouts/shard-00000.jsonl"
    shard.parent.mkdir(parents=True)
    lines = [json.dumps(trace("1", 0, 0.9)), json.dumps(trace("1", 1, 0.6)),     # group 1: only the best counts for SFT
             json.dumps(trace("2", 0, 0.3)),                                        # below min_reward
             json.dumps(trace("3", 0, None, status="failed", decision=False)),      # failed, no decision span
             '{"run_id": "run-a", "rollout_id": "3-1", "spa']                       # truncated by a crash
    # a disk or copy that garbled bytes: the line is counted, the rest of the shard still read
    nan = json.dumps(trace("4", 0, float("nan")))  # Python writes NaN, as a careless judge's or a hand's edit would
    shard.write_bytes(("\n".join([*lines, nan]) + "\n").encode() + b'{"run_id": "\xff"}\n')
    set_param(project, "datasets.sft.min_reward", 0.5)
    return project


def test_adapters_pick_first_attempt_junior_calls_of_top_rollouts(traced: Path) -> None:
    params = load_params()
    built = datasets.build(params.rollouts, params.datasets, params.validate_, ["junior_researcher"],
                           datasets.rl_agents(params))
    sft = built["sets"]["sft"]
    assert {r["rollout_id"] for r in sft} == {"1-0"}
    # the repaired hypothesis (attempt 2) and the unparsed attempt are out; tool step + first-try hypothesis are in
    assert [(r["agent"], r["completion"][0]["content"]) for r in sft] == [
        ("geneticist", '{"tool": "none", "query": ""}'), ("neurologist", '{"hypothesis": "n"}')]
    assert sft[0]["prompt"] == [SYSTEM, {"role": "user", "content": "go"}] and sft[0]["completion"][0]["role"] == "assistant"
    # each carries its task's worst rollout's same call (agent, n-th first-attempt call): the trainer's held-out pair
    assert [(r["rejected"]["output"], r["rejected"]["reward"]) for r in sft] == [
        ('{"tool": "none", "query": ""}', 0.6), ('{"hypothesis": "n"}', 0.6)]
    assert sft[1]["rejected"]["prompt"] == [SYSTEM, {"role": "user", "content": "hyp2"}]
    alone = datasets.build(params.rollouts, params.datasets.model_copy(update={"sft": params.datasets.sft.model_copy(
        update={"min_reward": 0.2})}), params.validate_, ["junior_researcher"], datasets.rl_agents(params))
    assert [r["rejected"] for r in alone["sets"]["sft"] if r["task_id"] == "2"] == [None, None]  # one rollout: no pair
    drops = built["drops"].counts
    assert drops["truncated_line"] == 1 and drops["sft.not_top_of_group"] == 1 and drops["sft.below_min_reward"] == 1
    assert built["drops"].examples["not_utf8"] == ["data/rollouts/shard-00000.jsonl:7: byte 12: invalid start byte"]
    assert built["drops"].examples["invalid_trace"] == ["data/rollouts/shard-00000.jsonl:6: reward: Input should be a finite number"]
    assert drops["sft.rollout_failed"] == 1 and drops["bandit.no_decision_span"] == 1
    assert any("shard-00000.jsonl:5" in e for e in built["drops"].examples["truncated_line"])
    rl = built["sets"]["rl"]
    # the RL role's trained agents only (ppo.roles.senior_researcher.agents), each with the schema it was decoded under
    assert {(r["agent"], r["role"], r["schema"]) for r in rl} == {("hypothesis_refiner", "senior_researcher", "Hypothesis")}
    assert rl[0]["abstract"] == "abstract 1"
    bandit = built["sets"]["bandit"]
    assert len(bandit) == 3 and bandit[0]["logging_pmf"] == pytest.approx([0.05, 0.95])
    assert bandit[0]["actions"][0]["author"] == "geneticist" and bandit[0]["actions"][0]["n_pmids"] == 1


def test_stage_writes_three_outputs_metrics_and_plots(traced: Path) -> None:
    import argparse

    assert datasets.main(argparse.Namespace(no_mlflow=True), load_params()) == 0
    out = traced / "data/datasets"
    assert len((out / "sft/junior_researcher/train.jsonl").read_text().splitlines()) == 2  # its own calls, one folder per role
    verl = pd.read_parquet(out / "rl/verl/train.parquet")
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(verl.columns)
    assert verl.iloc[0]["reward_model"]["ground_truth"] == "yes" and verl.iloc[0]["prompt"][0]["role"] == "system"
    from datasets import load_from_disk

    assert load_from_disk(str(out / "rl/hf")).num_rows == len(verl)
    metrics = json.loads((traced / "reports/datasets.json").read_text())
    assert metrics["sft.rows"] == 2 and metrics["dropped"]["truncated_line"] == 1
    assert (traced / "reports/plots/rewards.png").stat().st_size > 0
    assert "0.90-1.00,1,1" in (traced / "reports/plots/rewards.csv").read_text()


def test_empty_training_set_fails_with_reason_and_keeps_previous_outputs(traced: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    assert datasets.main(argparse.Namespace(no_mlflow=True), load_params()) == 0
    before = dvc_md5(traced / "data/datasets/sft")
    set_param(traced, "datasets.sft.min_reward", 0.95)
    assert datasets.main(argparse.Namespace(no_mlflow=True), load_params()) == 1
    err = capsys.readouterr().err
    assert "sft: 0 rows" in err and "sft.below_min_reward" in err and "min_reward=0.95" in err
    assert dvc_md5(traced / "data/datasets/sft") == before


def test_dvc_md5_matches_dvc(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha\n")
    (folder / "sub" / "b.bin").write_bytes(bytes(range(256)))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "d"], cwd=tmp_path, check=True)
    recorded = yaml.safe_load((tmp_path / "d.dvc").read_text())["outs"][0]["md5"]
    assert dvc_md5(folder) == recorded
