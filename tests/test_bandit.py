"""Contextual bandit: off-policy evaluation on synthetic logs with a known best action, and the pyfunc."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pipeline.bandit import features, ope
from pipeline.stages.train_bandit import evaluate_offline
from tests.conftest import mlflow_login, ROOT, section

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
    cfg = section("bandit", epsilon=0.05, passes=3, folds=4, bootstrap=300)
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

    from pipeline.bandit.policy import load_policy
    from pipeline.stages.train_bandit import log_model, train_final

    cfg = section("bandit", out_dir=str(tmp_path / "bandit"), passes=2)
    model_file = train_final(cfg, synthetic_logs(300))
    question = "Does the brain factor change outcome 3 in patients?"
    cands = [{"author": a, "hypothesis": "h", "rationale": "", "evidence_pmids": []} for a in AUTHORS]
    direct = load_policy(str(model_file)).pmf(question, cands)
    assert sum(direct) == pytest.approx(1.0) and max(range(3), key=direct.__getitem__) == 2
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("bandit-test")
    with mlflow.start_run(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        info = log_model(model_file, name="policy")
    # the stage's log: MLflow had asked for type hints on predict
    assert not [w for w in seen if w.category is UserWarning], [str(w.message)[:120] for w in seen if w.category is UserWarning]
    served = mlflow.pyfunc.load_model(info.model_uri).predict(pd.DataFrame([{"question": question, "candidates": cands}]))
    assert served[0] == pytest.approx(direct)
    assert load_policy(info.model_uri).pmf(question, cands) == pytest.approx(direct)
    # what a stage's routing check does in a fresh process, before anything has pointed MLflow at the
    # server (make run's report failed that way on a promoted policy: the client looked in ./mlflow.db)
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PIPELINE__MLFLOW__TRACKING_URI": mlflow_server,
           "PYTHONPATH": str(ROOT), "PIPELINE_PARAMS": str(ROOT / "params.yaml")}
    code = ("import json, sys; from pipeline.config import load_params; from pipeline.serving import routing; "
            "p = load_params(); print(json.dumps(routing.verify(p.serving, p.mlflow, "
            "{'roles': {}, 'policies': {'supervisor_policy': sys.argv[1]}})))")
    out = subprocess.run([sys.executable, "-c", code, info.model_uri], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {}, out.stdout  # no problem: the policy loaded


def test_inference_lines_match_training_lines() -> None:
    """The self-contained inference module (logged with the model) builds exactly the lines VW trained on."""
    from pipeline.bandit import vw, vw_policy

    logs = synthetic_logs(60, seed=3)
    for ex in logs:
        assert vw_policy.adf_lines(ex["context"], ex["actions"]) == vw.adf_lines(ex["context"], ex["actions"])
    ws = vw.train_policy(section("bandit", passes=1), logs)
    try:
        for ex in logs[:10]:
            assert vw_policy.pmf(ws, ex["context"], ex["actions"]) == vw.pmf(ws, ex["context"], ex["actions"])
    finally:
        ws.finish()


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.stages.train_bandit import train_final

    return train_final(section("bandit", out_dir=str(tmp_path_factory.mktemp("policy") / "bandit"), passes=2), synthetic_logs(300))


def _register(mlflow_server: str, model_file: Path, **pyfunc_kwargs) -> tuple[str, str]:
    """Log + register a policy the way train_bandit does (``log_model``, then a registry version of the logged model);
    with ``pyfunc_kwargs``, log that pyfunc instead."""
    import mlflow

    from pipeline import lineage
    from pipeline.learning import Learning, registered_name
    from pipeline.stages.train_bandit import log_model

    # its own registered model: the learning cycle shares this server, and its gate reads supervisor_policy's versions
    name = f"{registered_name(Learning.BANDIT, 'supervisor')}-bandit-test"
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("bandit-test")
    with mlflow.start_run() as run:
        info = mlflow.pyfunc.log_model(**pyfunc_kwargs) if pyfunc_kwargs else log_model(model_file, name)
    version = lineage.register_version(name, info.model_uri, run.info.run_id, {"kind": "contextual_bandit"})
    return name, str(version.version)


def _outside_env(mlflow_server: str) -> dict[str, str]:
    """A process that knows nothing of this repository: no PYTHONPATH, no pipeline settings, only the server."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("PIPELINE", "MLFLOW_"))}
    return {**env, "MLFLOW_TRACKING_URI": mlflow_server, **mlflow_login("reader")}  # loading a model only reads


@pytest.mark.slow
def test_registered_policy_loads_and_predicts_outside_the_checkout(tmp_path: Path, mlflow_server: str, policy_file: Path) -> None:
    """``mlflow.pyfunc.load_model("models:/supervisor_policy/<n>")`` in a fresh interpreter, run from a folder outside
    the repo with the repo off the path: the model carries its code (only the bandit's inference package), a signature
    and an input example, and predicts what the policy file does."""
    import mlflow

    from pipeline.bandit.policy import load_policy
    from pipeline.stages.train_bandit import INPUT_EXAMPLE

    name, version = _register(mlflow_server, policy_file)
    files = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(tmp_path / "dl")))
    code = sorted(str(p.relative_to(files / "code")) for p in (files / "code").rglob("*.py"))
    assert code == ["supervisor_bandit/__init__.py", "supervisor_bandit/features.py", "supervisor_bandit/vw_policy.py"]
    assert not re.search(r"^\s*(from|import) pipeline", (files / "code/supervisor_bandit/vw_policy.py").read_text(), re.M)
    expected = load_policy(str(policy_file)).pmf(INPUT_EXAMPLE["question"], INPUT_EXAMPLE["candidates"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = ("import importlib.util, json, sys\n"
              "assert importlib.util.find_spec('pipeline') is None, 'the repo is importable'\n"
              "import mlflow.pyfunc\n"
              "model = mlflow.pyfunc.load_model(sys.argv[1])\n"
              "sig = model.metadata.signature\n"
              "assert sig is not None and [c.name for c in sig.inputs.inputs] == ['question', 'candidates'], sig\n"
              "assert model.input_example is not None\n"
              "out = model.predict(model.input_example)\n"
              "assert not [m for m in sys.modules if m == 'pipeline' or m.startswith('pipeline.')]\n"
              "print(json.dumps([list(map(float, row)) for row in out]))\n")
    proc = subprocess.run([sys.executable, "-c", script, f"models:/{name}/{version}"], cwd=outside, env=_outside_env(mlflow_server),
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.splitlines()[-1])
    assert row == pytest.approx(expected) and sum(row) == pytest.approx(1.0)


TRAP = """import os
if os.environ.get("POLICY_TRAP_LOGGING") != "1":
    raise SystemExit("the registered model's code was executed")
import mlflow
from pipeline.bandit.vw_policy import SupervisorPolicyModel
mlflow.models.set_model(SupervisorPolicyModel())
"""


@pytest.mark.slow
def test_load_policy_never_runs_the_registered_models_code(tmp_path: Path, mlflow_server: str, policy_file: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A version whose model code (and code/ package) exits the process when executed: pyfunc loading it does exit,
    load_policy on its models:/ URI (and its alias) still returns the policy, read from the ``.vw`` artifact."""
    import mlflow

    from pipeline.bandit.policy import load_policy
    from pipeline.registry import set_alias

    trap = tmp_path / "trap_model.py"
    trap.write_text(TRAP)
    package = tmp_path / "supervisor_bandit"
    package.mkdir()
    (package / "__init__.py").write_text('raise SystemExit("the registered model\'s code/ was imported")\n')
    monkeypatch.setenv("POLICY_TRAP_LOGGING", "1")  # mlflow runs the model code once while logging it
    name, version = _register(mlflow_server, policy_file, name="policy", python_model=str(trap), artifacts={"vw_model": str(policy_file)},
                              code_paths=[str(package)], pip_requirements=["vowpalwabbit"])
    monkeypatch.delenv("POLICY_TRAP_LOGGING")
    uri = f"models:/{name}/{version}"
    # the trap works: a pyfunc load of this version (in its own process) exits
    proc = subprocess.run([sys.executable, "-c", "import sys, mlflow.pyfunc; mlflow.pyfunc.load_model(sys.argv[1]); print('loaded')", uri],
                          cwd=tmp_path, env=_outside_env(mlflow_server), capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode != 0 and "was executed" in proc.stderr and "loaded" not in proc.stdout, (proc.stdout, proc.stderr[-2000:])

    def no_pyfunc(*a, **k):
        raise AssertionError("load_policy called mlflow.pyfunc.load_model")

    monkeypatch.setattr(mlflow.pyfunc, "load_model", no_pyfunc)
    path_before, modules_before = list(sys.path), set(sys.modules)
    cands = [{"author": a, "hypothesis": "h", "rationale": "", "evidence_pmids": []} for a in AUTHORS]
    question = "Does the brain factor change outcome 3 in patients?"
    direct = load_policy(str(policy_file)).pmf(question, cands)
    set_alias(name, "trap", version)
    for target in (uri, f"models:/{name}@trap"):
        policy = load_policy(target)
        assert policy.pmf(question, cands) == pytest.approx(direct)
        assert policy.source == target and policy.version == version and policy.model_file == f"{uri}/artifacts/policy.vw"
    # the same files by run (runs:/<run>/<model name>) and as a local MLflow model folder: no version, still no code run
    run_id = mlflow.MlflowClient().get_model_version(name, version).run_id
    folder = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "folder"))
    for target in (f"runs:/{run_id}/policy", folder):
        policy = load_policy(target)
        assert policy.pmf(question, cands) == pytest.approx(direct) and policy.source == target and policy.version is None
    # nothing of the model's code was put on the path or imported (mlflow names a code model's module code_model_<hex>)
    assert sys.path == path_before
    assert not [m for m in set(sys.modules) - modules_before if m.startswith(("supervisor_bandit", "code_model_"))]


@pytest.mark.slow
def test_load_policy_checks_the_versions_sha256_tag(mlflow_server: str, policy_file: Path) -> None:
    """A version tagged ``sha256``: the downloaded ``.vw`` must match it (a wrong tag is refused, naming both digests)."""
    import hashlib

    from pipeline.bandit.policy import PolicyDigestError, load_policy
    from pipeline.registry import set_alias, set_tags

    name, version = _register(mlflow_server, policy_file)
    actual = hashlib.sha256(policy_file.read_bytes()).hexdigest()
    assert load_policy(f"models:/{name}/{version}").sha256 == actual  # no tag: loaded, digest recorded
    wrong = hashlib.sha256(b"another policy").hexdigest()
    set_tags(name, version, {"sha256": wrong})
    set_alias(name, "tampered", version)
    for uri in (f"models:/{name}/{version}", f"models:/{name}@tampered"):
        with pytest.raises(PolicyDigestError) as err:
            load_policy(uri)
        assert actual in str(err.value) and wrong in str(err.value)
    set_tags(name, version, {"sha256": actual.upper()})
    assert load_policy(f"models:/{name}@tampered").sha256 == actual


def test_supervisor_with_bandit_policy_logs_its_propensity(tmp_path: Path) -> None:
    """The supervisor node with a trained policy: no LLM call, the pick sampled from the policy's
    distribution, and the decision span records that distribution and the pick's probability."""
    import asyncio

    from pipeline.agents.graph import Society
    from pipeline.bandit.policy import load_policy
    from pipeline.stages.train_bandit import train_final

    model_file = train_final(section("bandit", out_dir=str(tmp_path / "bandit"), passes=2), synthetic_logs(300))
    policy = load_policy(str(model_file))
    hyps = [{"author": a, "hypothesis": f"{a} idea", "rationale": "r", "evidence_pmids": []} for a in AUTHORS]
    picks = []
    for seed in range(40):
        society = Society(client=None, tools=None, cfg=section("agents", supervisor_policy="bandit"), rng=random.Random(seed), policy=policy)
        out = asyncio.run(society.supervisor({"task": {"question": "Does the drug factor change outcome 7 in patients?"},
                                              "hypotheses": list(reversed(hyps))}))
        (span,) = out["spans"]
        d = span["data"]
        assert span["kind"] == "decision" and d["policy"] == "bandit" and d["policy_source"] == str(model_file)
        assert sum(d["pmf"]) == pytest.approx(1.0) and d["propensity"] == pytest.approx(d["pmf"][d["chosen"]])
        assert d["candidates"] == AUTHORS and out["selection"]["author"] == AUTHORS[d["chosen"]]
        picks.append(d["chosen"])
    assert max(set(picks), key=picks.count) == 1  # the pharmacologist, whom the policy learned to prefer for drug questions
