"""Contextual bandit: off-policy evaluation on synthetic logs with a known best action, and the pyfunc."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bandit import features, ope
from pipeline.config import BanditParams
from pipeline.stages.train_bandit import evaluate_offline
from tests.conftest import ROOT

AUTHORS = ["geneticist", "pharmacologist", "neurologist"]
TOPICS = {"gene": "geneticist", "drug": "pharmacologist", "brain": "neurologist"}


def synthetic_logs(n: int, seed: int = 0, epsilon: float = 0.6) -> list[dict]:
    """The best candidate is the junior whose field matches the question's topic word (reward ~0.8 vs ~0.2).
    The logging policy is epsilon-greedy around a fixed, topic-blind favourite (the geneticist)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.choice(list(TOPICS))
        question = f"Does the {topic} factor change outcome {rng.randint(0, 50)} in patients?"
        cands = [{"author": a, "hypothesis": f"{a} hypothesis {rng.random():.2f}", "rationale": "", "evidence_pmids": []} for a in AUTHORS]
        context, actions = features.decision_features(question, cands)
        pmf = [(1 - epsilon) * (j == 0) + epsilon / 3 for j in range(3)]
        chosen = rng.choices(range(3), weights=pmf)[0]
        reward = min(1.0, max(0.0, (0.8 if AUTHORS[chosen] == TOPICS[topic] else 0.2) + rng.gauss(0, 0.1)))
        rows.append({"rollout_id": f"r{i}", "run_id": "synthetic", "context": context, "actions": actions, "chosen": chosen,
                     "propensity": pmf[chosen], "logging_pmf": pmf, "reward": reward})
    return rows


def test_learned_policy_beats_logging_policy_with_separated_cis() -> None:
    cfg = BanditParams(epsilon=0.05, passes=3, folds=4, bootstrap=300)
    est = evaluate_offline(cfg, synthetic_logs(900))
    learned, logging = est["learned"]["dr"], est["logging"]["dr"]
    assert learned["value"] > logging["value"] + 0.2
    assert learned["ci_low"] > logging["ci_high"], (learned, logging)
    # the logging policy's IPS estimate is just the mean logged reward, and every estimator agrees on it
    assert abs(est["logging"]["ips"]["value"] - est["logging"]["snips"]["value"]) < 1e-9


def test_ope_matches_hand_computed_values() -> None:
    # two decisions, two actions; target always picks action 1
    target = [[0.0, 1.0], [0.0, 1.0]]
    est = ope.estimate(target, chosen=[1, 0], propensity=[0.5, 0.5], reward=[1.0, 0.0], q=[[0.2, 0.6], [0.2, 0.6]], n_boot=100)
    assert est["ips"]["value"] == pytest.approx((2 * 1.0 + 0) / 2)
    assert est["snips"]["value"] == pytest.approx(2.0 / 2.0)
    assert est["dr"]["value"] == pytest.approx(((0.6 + 2 * (1.0 - 0.6)) + (0.6 + 0)) / 2)
    with pytest.raises(ValueError, match="propensities"):
        ope.estimate(target, chosen=[1, 0], propensity=[0.0, 0.5], reward=[1.0, 0.0], q=[[0, 0], [0, 0]])


@pytest.mark.slow
def test_policy_file_and_mlflow_pyfunc_give_the_same_distribution(tmp_path: Path, mlflow_server: str) -> None:
    import mlflow
    import pandas as pd

    from pipeline.bandit import mlflow_model
    from pipeline.bandit.policy import load_policy
    from pipeline.stages.train_bandit import train_final

    cfg = BanditParams(out_dir=str(tmp_path / "bandit"), passes=2)
    model_file = train_final(cfg, synthetic_logs(300))
    question = "Does the brain factor change outcome 3 in patients?"
    cands = [{"author": a, "hypothesis": "h", "rationale": "", "evidence_pmids": []} for a in AUTHORS]
    direct = load_policy(str(model_file)).pmf(question, cands)
    assert sum(direct) == pytest.approx(1.0) and max(range(3), key=direct.__getitem__) == 2
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("bandit-test")
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(name="policy", python_model=mlflow_model.__file__, artifacts={"vw_model": str(model_file)},
                                       pip_requirements=["vowpalwabbit"])
    served = mlflow.pyfunc.load_model(info.model_uri).predict(pd.DataFrame([{"question": question, "candidates": cands}]))
    assert served[0] == pytest.approx(direct)
    assert load_policy(info.model_uri).pmf(question, cands) == pytest.approx(direct)
    # what a stage's routing check does in a fresh process, before anything has pointed MLflow at the
    # server (make run's report failed that way on a promoted policy: the client looked in ./mlflow.db)
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PIPELINE__MLFLOW__TRACKING_URI": mlflow_server,
           "PYTHONPATH": str(ROOT), "PIPELINE_PARAMS": str(ROOT / "params.yaml")}
    code = ("import json, sys; from pipeline.config import load_params; from pipeline.serving import routing; "
            "print(json.dumps(routing.verify(load_params(), {'roles': {}, 'policies': {'supervisor_policy': sys.argv[1]}})))")
    out = subprocess.run([sys.executable, "-c", code, info.model_uri], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {}, out.stdout  # no problem: the policy loaded


def test_supervisor_with_bandit_policy_logs_its_propensity(tmp_path: Path) -> None:
    """The supervisor node with a trained policy: no LLM call, the pick sampled from the policy's
    distribution, and the decision span records that distribution and the pick's probability."""
    import asyncio

    from pipeline.agents.graph import Society
    from pipeline.bandit.policy import load_policy
    from pipeline.config import AgentsParams
    from pipeline.stages.train_bandit import train_final

    model_file = train_final(BanditParams(out_dir=str(tmp_path / "bandit"), passes=2), synthetic_logs(300))
    policy = load_policy(str(model_file))
    hyps = [{"author": a, "hypothesis": f"{a} idea", "rationale": "r", "evidence_pmids": []} for a in AUTHORS]
    picks = []
    for seed in range(40):
        society = Society(client=None, tools=None, cfg=AgentsParams(supervisor_policy="bandit"), rng=random.Random(seed), policy=policy)
        out = asyncio.run(society.supervisor({"task": {"question": "Does the drug factor change outcome 7 in patients?"},
                                              "hypotheses": list(reversed(hyps))}))
        (span,) = out["spans"]
        d = span["data"]
        assert span["kind"] == "decision" and d["policy"] == "bandit" and d["policy_source"] == str(model_file)
        assert sum(d["pmf"]) == pytest.approx(1.0) and d["propensity"] == pytest.approx(d["pmf"][d["chosen"]])
        assert d["candidates"] == AUTHORS and out["selection"]["author"] == AUTHORS[d["chosen"]]
        picks.append(d["chosen"])
    assert max(set(picks), key=picks.count) == 1  # the pharmacologist, whom the policy learned to prefer for drug questions
