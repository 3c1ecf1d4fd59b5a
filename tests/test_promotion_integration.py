"""Judge-gated promotion for real (slow): registry, evaluation on the validation split through an
evaluation routing, the gate, routing on promotion, rollback, a failed promotion.

SmolLM2 behind the session's shared serving stack, its own MLflow server (the registry must start
empty here). The worse junior is the random-weight test model, served for this module in the
stack's spare worker slot ("offline", which the proxy already knows) with a context of
``BROKEN_CONTEXT`` tokens: the routing check's 4-token "hi" fits, no junior call does (vLLM answers
400), so every rollout its juniors take part in fails and scores 0. Random weights alone are not
worse for sure: guided decoding lets them write a valid hypothesis and the SmolLM2 judge's noise
decides (CI runs saw a random-weight junior win by +0.74 and a random-weight champion score 0.93).
Stopping the worker during `evaluate` does not work either: the stage brings the serving plane up
first. The slot is emptied for the routing-failure test, where "offline" must be down: the module's last test, so
nothing boots the worker again. The tests run in file order and build on each other's registry and evidence.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import httpx
import pytest
import yaml

from pipeline.config import Params, load_params
from pipeline.versions import Line
from tests.conftest import PUBMEDQA, ROOT

pytestmark = pytest.mark.slow

# 25 of the 500 non-test questions for validation (the default: 100): a role-level evaluation asks each of them (three
# versions at once in the PI's test), and 25 is promote.min_tasks, the fewest the default gate decides on (#54)
VAL_QUESTIONS = 25
SMALL = {"agents": {"max_review_rounds": 0, "max_tool_calls": 0, "max_tokens": 128, "json_retries": 1, "context_chars": 200,
                    "text_scale": 0.4, "decision": {"rationale_tokens": 16}},  # shorter answers: fewer tokens a society (#54)
         "judge": {"abstract_chars": 400}, "rollouts": {"retries": 0},
         "evaluate": {"limit": 2, "bootstrap": 200}, "report": {"limit": 2}, "split": {"val_fraction": VAL_QUESTIONS / 500},
         "validate": {"split_rows": {"train": {"min": 500 - VAL_QUESTIONS, "max": 500 - VAL_QUESTIONS}, "val": {"min": VAL_QUESTIONS, "max": VAL_QUESTIONS}}}}
BROKEN_CONTEXT = 96  # tokens: > the routing check's prompt + 4, < any junior call's max_tokens alone


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


@pytest.fixture(scope="module")
def promo(serving_stack: Params, serving_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from pipeline import tracking
    from pipeline.services import mlflow_server
    from pipeline.services.process import free_port
    from pipeline.serving import routing, worker
    from pipeline.stages import build_index, ingest, validate

    root = tmp_path_factory.mktemp("promotion")
    raw = _merge(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL)
    raw["data"].update(source=str(PUBMEDQA / "ori_pqal.json"), test_ids=str(PUBMEDQA / "test_ground_truth.json"))
    raw["data"]["allow"]["local_roots"] = [str(PUBMEDQA)]
    s = serving_stack.serving
    # the "offline" slot, serving random weights with too short a context for any society call
    tiny = {**s.workers[1].model_dump(), "model": str(serving_models / "tiny"), "max_model_len": BROKEN_CONTEXT}
    raw["serving"].update(home=s.home, routing_dir=s.routing_dir, proxy=s.proxy.model_dump(), workers=[s.workers[0].model_dump(), tiny])
    raw["mlflow"].update(home=str(root / "mlflow"), port=free_port(), experiment="promotion-it")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    saved_cwd, saved_uri = os.getcwd(), os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.chdir(root)
    env_keys = [k for k in os.environ if k.startswith("PIPELINE__")]
    saved_env = {k: os.environ.pop(k) for k in env_keys}
    params = load_params(root / "params.yaml")
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        offline = pool.submit(worker.up, params.serving, params.serving.workers[1])  # starts beside the stages below
        ingest.run(params)
        validate.run(params)
        build_index.run(params)
        routing.apply(params.serving, params.mlflow, 1)
        mlflow_server.ensure(params.mlflow)  # what the CLI does before a command that tracks
        uri = tracking.setup(params.mlflow)
        offline.result()
        yield {"root": root, "params": params, "uri": uri}
    finally:
        pool.shutdown()
        worker.down(params.serving, params.serving.workers[1])
        routing.apply(params.serving, params.mlflow, 1)
        mlflow_server.down(params.mlflow)
        os.chdir(saved_cwd)
        os.environ.update(saved_env)
        if saved_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved_uri


def _env(promo: dict, **extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")}, "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": promo["uri"], "PIPELINE_RUN_ID": "promotion-it", **extra}


def _cli(promo: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` as a user runs it, in this process: the same entry point, parser, params from the
    environment and one-line errors, without a new interpreter's ~3 s of imports (MLflow's 1.6) for each of this
    module's ~40 calls (#54). A claim about the process itself (killed mid-switch, its tracking server gone) is
    :func:`_process`'s."""
    import mlflow

    from pipeline import cli

    out, err = io.StringIO(), io.StringIO()
    with (mock.patch.dict(os.environ, _env(promo, **extra), clear=True), contextlib.chdir(promo["root"]),
          contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:  # argparse's refusals
            rc = exc.code if isinstance(exc.code, int) else 2
        finally:
            while mlflow.active_run() is not None:  # a process's exit would have ended it
                mlflow.end_run("FAILED")
            mlflow.set_tracking_uri(promo["uri"])
    return subprocess.CompletedProcess(["python", "-m", "pipeline", *args], rc, out.getvalue(), err.getvalue())


def _process(promo: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=promo["root"], env=_env(promo, **extra),
                          capture_output=True, text=True)


def _register(promo: dict, deployment: str, role: str = "junior_researcher") -> str:
    """A new ``role`` version served by ``deployment`` (kind base), registered as a trainer does (challenger)."""
    import mlflow

    from pipeline import registry

    with mlflow.start_run(run_name="it-candidate") as run:
        mlflow.log_dict({"deployment": deployment}, "model/deployment.json")
    tags = {"kind": "base", "deployment": deployment}
    return registry.register_candidate(promo["params"], role, f"runs:/{run.info.run_id}/model", run.info.run_id, tags).version


def _live(promo: dict) -> dict:
    from pipeline.serving import routing

    return routing.active(promo["params"].serving)


def _served(promo: dict, role: str) -> str:
    from pipeline.serving import proxy

    url, key = proxy.client_settings(promo["params"].serving)
    resp = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"model": role, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-litellm-model-group"]


def _swap_evidence(promo: dict, version: str) -> None:
    """The first test's evaluation, sides swapped, as the evidence for base (``version``) against the
    broken champion: the same two questions, base's real scores and the broken model's zeros. Evaluating
    the same pair again would repeat those numbers for 2.5 more minutes of CI; `evaluate` itself is what
    the first test and the learning cycle check."""
    path = promo["root"] / "data/evaluation/summary.json"
    summary = json.loads(path.read_text())
    entry = summary["roles"]["junior_researcher"]
    assert entry["candidate"]["target"] == "offline" and entry["champion"]["target"] == "base"
    d = entry["difference"]
    entry["candidate"], entry["champion"] = {**entry["champion"], "version": version}, {**entry["candidate"], "version": "2"}
    entry["difference"] = {**d, "mean": -d["mean"], "ci_low": -d["ci_high"], "ci_high": -d["ci_low"]}
    summary["roles"] = {"junior_researcher": entry}  # the A/A senior of the first test was decided there
    path.write_text(json.dumps(summary))
    promo["win"] = copy.deepcopy(entry)  # the routing-failure test's evidence, at the module's end


def _champion(name: str) -> str:
    from pipeline import registry

    return registry.by_alias(name, registry.CHAMPION).version


def test_worse_candidate_and_an_identical_copy_are_not_promoted(promo: dict) -> None:
    """One evaluation, two challengers. The junior is the random-weight model (worse for sure, see the module's
    docstring). The senior is A/A: the champion's own model registered again under a new version number. Its
    society replays the champion's calls before the senior's first one, and its own calls sample with the champion's
    seeds (agents.seeded_calls), so the paired difference holds only what the copy changed: nothing, up to the CPU
    engine's batch numerics. With its task floor lowered to the 2 tasks evaluated, the gate must not promote it."""
    from mlflow import MlflowClient

    version = _register(promo, "offline")  # the random-weight model
    assert version == "2" and _champion("junior_researcher") == "1"  # v1: the baseline, registered on first use
    assert MlflowClient().get_model_version("junior_researcher", "1").tags["kind"] == "base"
    before = _live(promo)
    same = before["roles"]["senior_researcher"]
    copy = _register(promo, same, "senior_researcher")
    assert copy == "2" and _champion("senior_researcher") == "1"
    # at the default floor (25 tasks) two validation tasks cannot decide: nothing is run, both are listed with the reason
    ev = _cli(promo, "evaluate")
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    skipped = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    assert skipped["roles"] == {} and set(skipped["unevaluated"]) == {"junior_researcher", "senior_researcher"}
    assert "< promote.min_tasks=25" in skipped["unevaluated"]["junior_researcher"]["reason"]
    ev = _cli(promo, "evaluate", PIPELINE__PROMOTE__MIN_TASKS="2")  # the floor at the 2 tasks: the societies run
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    summary = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    entry = summary["roles"]["junior_researcher"]
    assert entry["candidate"]["target"] == "offline" and len(summary["tasks"]) == 2
    assert entry["difference"]["n"] == 2 and entry["champion"]["metrics"]["tasks"] == 2
    predictions = json.loads((promo["root"] / "data/evaluation/predictions/junior_researcher-candidate.json").read_text())
    assert set(predictions) == set(summary["tasks"]) and set(predictions.values()) <= {"yes", "no", "maybe"}
    assert entry["difference"]["p_value"] >= 0.25 and "p_value" in entry["difference"]["decision"]  # exact tests, next to the CI
    aa = summary["roles"]["senior_researcher"]
    assert aa["candidate"]["target"] == aa["champion"]["target"] == same and aa["difference"]["n"] == 2
    # the copy's society answered the juniors' and the supervisor's calls from the champion's record
    assert aa["cost"]["candidate"]["replayed_calls_per_task"] > 0 and aa["cost"]["candidate"]["live_calls_per_task"] > 0
    pr = _cli(promo, "promote")  # 2 tasks < promote.min_tasks: no decision either way
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    for role in ("junior_researcher", "senior_researcher"):
        assert f"{role} v2: INSUFFICIENT_EVIDENCE (insufficient_evidence)" in pr.stdout, pr.stdout
        assert json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"][role]["status"] == "insufficient_evidence"
    pr = _cli(promo, "promote", PIPELINE__PROMOTE__MIN_TASKS="2")  # with the floor lowered, the numbers decide
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    assert "junior_researcher v2: REJECTED" in pr.stdout, pr.stdout
    assert entry["candidate"]["metrics"]["reward"]["mean"] <= entry["champion"]["metrics"]["reward"]["mean"]
    # the copy: rejected by whichever rule its noise trips (no gain above the margin, no significant one, or, from the
    # sampled PI decisions of two tasks, a drop in decision accuracy); what it must never be is promoted
    decision = json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"]["senior_researcher"]
    assert decision["status"] == "rejected" and decision["rule"] in ("margin", "significance", "accuracy_drop"), decision
    assert _champion("junior_researcher") == "1" and _champion("senior_researcher") == "1" and _live(promo) == before
    tags = MlflowClient().get_model_version("junior_researcher", "2").tags
    assert tags["promotion.decision"] == "rejected" and tags["promotion.rule"] and "eval.diff_ci" in tags
    # #56: the candidates' evaluation tables ended with their evaluation (a refused candidate is not reachable by name)
    from pipeline.serving import proxy

    assert not list(proxy.active_file(promo["params"].serving).with_name("eval").glob("*.json"))
    # a decision, once recorded, is history: promote again on the same evidence reports it and rewrites nothing
    aa_tags = MlflowClient().get_model_version("senior_researcher", "2").tags
    again = _cli(promo, "promote", PIPELINE__PROMOTE__MIN_TASKS="2", PIPELINE__PROMOTE__MARGIN="5.0")
    assert again.returncode == 0 and "senior_researcher v2: REJECTED (decided)" in again.stdout, again.stdout[-3000:]
    assert MlflowClient().get_model_version("senior_researcher", "2").tags == aa_tags
    # the evaluation is browsable as MLflow GenAI evaluation: per-question traces carry the judge's scores
    import mlflow

    traces = mlflow.search_traces(run_id=entry["candidate"]["run_id"], return_type="list")
    assert len(traces) == 2 and {"reward", "groundedness", "pubmedqa_answer"} <= {a.name for a in traces[0].info.assessments}
    assert (promo["root"] / "reports/plots/evaluate.png").stat().st_size > 0


def test_better_candidate_is_promoted_then_rolled_back(promo: dict) -> None:
    from mlflow import MlflowClient

    from pipeline import registry
    from pipeline.stages.promote import switch

    # a random-weight champion, put in place the way a promotion does
    switch(promo["params"].serving, promo["params"].mlflow, Line("junior_researcher"),
           registry.get_version("junior_researcher", "2"), "it: random-weight champion")
    assert _served(promo, "junior_researcher") == "offline"
    version = _register(promo, "base")
    _swap_evidence(promo, version)
    # two questions cannot make a bootstrap CI exclude 0 if SmolLM2 fails one of them; the significance
    # rule is unit-tested (test_promotion_gate.py), here the gain over a champion that scores 0 decides
    pr = _cli(promo, "promote", PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE="false", PIPELINE__PROMOTE__MIN_TASKS="2")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    assert f"junior_researcher v{version}: PROMOTED" in pr.stdout, pr.stdout
    assert _champion("junior_researcher") == version
    assert _live(promo)["roles"]["junior_researcher"] == "base" and _served(promo, "junior_researcher") == "base"
    tags = MlflowClient().get_model_version("junior_researcher", version).tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.previous_champion"] == "2"
    report = json.loads((promo["root"] / "reports/promotion.json").read_text())
    assert report["promoted"] == ["junior_researcher"] and report["routing_version"] == _live(promo)["version"]

    # what decides what is served is not a registry tag (#44): a forged previous champion is ignored, a forged digest refused
    client = MlflowClient()
    client.set_model_version_tag("junior_researcher", version, "promotion.previous_champion", "1")
    digest = client.get_model_version("junior_researcher", "2").tags.get("sha256")  # a base version may carry none
    client.set_model_version_tag("junior_researcher", "2", "sha256", "0" * 64)
    forged = _cli(promo, "rollback", "junior_researcher")
    assert forged.returncode == 1 and "promotion journal recorded it" in forged.stderr, forged.stdout + forged.stderr
    assert _champion("junior_researcher") == version and _served(promo, "junior_researcher") == "base"
    if digest is None:
        client.delete_model_version_tag("junior_researcher", "2", "sha256")
    else:
        client.set_model_version_tag("junior_researcher", "2", "sha256", digest)
    # #56: a base version has no digest; its `deployment` tag pointed at another deployment is not what rollback routes
    client.set_model_version_tag("junior_researcher", "2", "deployment", "base")
    forged = _cli(promo, "rollback", "junior_researcher")
    assert forged.returncode == 1 and "promotion journal recorded offline" in forged.stderr, forged.stdout + forged.stderr
    client.set_model_version_tag("junior_researcher", "2", "deployment", "offline")
    rb = _cli(promo, "rollback", "junior_researcher")
    assert rb.returncode == 0, rb.stdout + rb.stderr
    assert _champion("junior_researcher") == "2" and _served(promo, "junior_researcher") == "offline"
    # #56: a rollback sticks. The same evidence again: its decision is history (now rolled_back), nothing switches
    gate = {"PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE": "false", "PIPELINE__PROMOTE__MIN_TASKS": "2"}
    again = _cli(promo, "promote", **gate)
    assert again.returncode == 0 and f"junior_researcher v{version}: REJECTED (decided)" in again.stdout, again.stdout
    # and evidence from before the rollback, whatever version it names, is stale
    other = _register(promo, "base")
    summary_path = promo["root"] / "data/evaluation/summary.json"
    older = json.loads(summary_path.read_text())
    older["roles"]["junior_researcher"]["candidate"]["version"] = other
    summary_path.write_text(json.dumps(older))
    stale = _cli(promo, "promote", **gate)
    assert stale.returncode == 0 and f"junior_researcher v{other}: REJECTED (stale)" in stale.stdout, stale.stdout
    assert "was rolled back at" in stale.stdout and _champion("junior_researcher") == "2"
    from pipeline.promotion import journal, journal_file

    entries = journal(promo["params"].serving)
    assert [(e["action"], e["version"]) for e in entries if e["role"] == "junior_researcher"][-2:] == [("promote", version),
                                                                                                       ("rollback", "2")]
    assert journal_file(promo["params"].serving).stat().st_mode & 0o777 == 0o600
    # an alias moved outside promote/rollback: the journal disagrees, nothing is switched
    registry.set_alias("junior_researcher", registry.CHAMPION, version)
    moved = _cli(promo, "rollback", "junior_researcher")
    assert moved.returncode == 1 and "changed outside promote/rollback" in moved.stderr, moved.stdout + moved.stderr
    served = _cli(promo, "services", "up", "serving")  # every stage's stack.ensure refuses it too, in one line
    assert served.returncode == 1 and "changed outside promote/rollback" in served.stderr, served.stdout + served.stderr
    assert "Traceback" not in served.stderr
    registry.set_alias("junior_researcher", registry.CHAMPION, "2")
    # #56: the journal gone, torn or unreadable while a champion is not its baseline: an error naming the way back
    path = journal_file(promo["params"].serving)
    kept = path.read_bytes()
    for damage in ("removed", "torn", "not_utf8", "not_a_switch"):
        path.unlink(missing_ok=True)
        if damage == "torn":
            path.write_bytes(kept.splitlines()[0][:40])
        elif damage == "not_utf8":
            path.write_bytes(kept + b"\xff\xfe\n")
        elif damage == "not_a_switch":
            path.write_bytes(kept + b"[1, 2]\n")
        served = _cli(promo, "services", "up", "serving")
        lines = served.stderr.strip().splitlines()
        assert served.returncode == 1 and len(lines) == 1 and "Traceback" not in served.stderr, (damage, served.stderr)
        assert {"removed": "records no switch", "torn": "records no switch", "not_utf8": "cannot be read",
                "not_a_switch": "is not a switch"}[damage] in lines[0] and "restore it" in lines[0], (damage, lines)
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, kept)
    os.close(fd)
    # #56: `promote` whose tracking server is gone ends within its deadline in one line, nothing switched
    import time

    from pipeline.services.process import free_port

    before, started = _live(promo), time.monotonic()
    gone = _process(promo, "promote", MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}",
                PIPELINE__MLFLOW__REQUEST_TIMEOUT_S="2", **gate)
    lines = gone.stderr.strip().splitlines()
    assert gone.returncode == 1 and len(lines) == 1 and "did not answer" in lines[0], gone.stdout[-2000:] + gone.stderr
    assert time.monotonic() - started < 60 and _live(promo) == before and _champion("junior_researcher") == "2"


def test_promote_killed_after_each_step_then_rerun_leaves_alias_routing_and_tags_agreeing(promo: dict) -> None:
    """SIGKILL `promote` right after each step of a switch, run it again (as the DAG's retry does): the rerun
    settles the interrupted switch and the role ends promoted once, with alias, live routing and tags agreeing."""
    from mlflow import MlflowClient

    from pipeline import registry
    from pipeline.promotion import STEPS, intent_file, switch

    summary_path = promo["root"] / "data/evaluation/summary.json"
    won = json.loads(summary_path.read_text())  # base beat the broken champion v2 (the previous test's evidence)
    from datetime import UTC, datetime

    won["created_at"] = datetime.now(UTC).isoformat(timespec="seconds")  # evidence newer than the previous test's rollback
    for step in STEPS:
        switch(promo["params"].serving, promo["params"].mlflow, Line("junior_researcher"),
               registry.get_version("junior_researcher", "2"), f"it: broken champion before {step}")
        version = _register(promo, "base")
        won["roles"]["junior_researcher"]["candidate"]["version"] = version
        summary_path.write_text(json.dumps(won))
        gate = {"PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE": "false", "PIPELINE__PROMOTE__MIN_TASKS": "2"}
        killed = _process(promo, "promote", PIPELINE_FAILPOINT=f"switch.{step}", **gate)
        assert killed.returncode == -9, (step, killed.stdout[-2000:], killed.stderr[-2000:])
        assert intent_file(promo["params"].serving).exists()
        rerun = _cli(promo, "promote", **gate)
        assert rerun.returncode == 0, (step, rerun.stdout[-3000:], rerun.stderr[-3000:])
        assert "reconcile:" in rerun.stdout and not intent_file(promo["params"].serving).exists()
        live = _live(promo)
        tags = MlflowClient().get_model_version("junior_researcher", version).tags
        assert _champion("junior_researcher") == version and live["roles"]["junior_researcher"] == "base", step
        assert _served(promo, "junior_researcher") == "base", step
        assert tags["promotion.decision"] == "promoted" and tags["promotion.previous_champion"] == "2", (step, tags)
        assert tags["promotion.routing_version"] == str(live["version"]), (step, tags, live)
        report = json.loads((promo["root"] / "reports/promotion.json").read_text())
        assert report["promoted"] == ["junior_researcher"] and report["routing_version"] == live["version"], step
        assert registry.by_alias("junior_researcher", registry.CHALLENGER) is None, step
    switch(promo["params"].serving, promo["params"].mlflow, Line("junior_researcher"),
           registry.get_version("junior_researcher", "2"), "it: broken champion again")


def test_a_gate_that_asks_a_person_waits_then_an_approval_switches_and_a_refusal_switches_nothing(promo: dict) -> None:
    """#55 outside Airflow: the role's gate says `approval: required`. A candidate that passes waits (awaiting_approval:
    its alias kept, nothing switched); `promote --approve` switches it through the same switch and journal a promotion
    takes; `promote --reject` records not_approved on the version and in the journal, and the same evidence is not
    asked again."""
    from datetime import UTC, datetime

    from pipeline import registry
    from pipeline.promotion import journal, journal_file, switch

    jr, params = "junior_researcher", promo["params"]
    summary_path = promo["root"] / "data/evaluation/summary.json"
    won = json.loads(summary_path.read_text())  # base beat the broken champion v2
    won["created_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    gate = {"PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE": "false", "PIPELINE__PROMOTE__MIN_TASKS": "2",
            "PIPELINE__ROLES__JUNIOR_RESEARCHER__GATE": "{approval: required}"}
    for answer in ("approve", "reject"):
        assert _champion(jr) == "2"
        before, version = _live(promo), _register(promo, "base")
        won["roles"][jr]["candidate"]["version"] = version
        summary_path.write_text(json.dumps(won))
        pr = _cli(promo, "promote", **gate)
        assert pr.returncode == 0 and f"{jr} v{version}: AWAITING_APPROVAL" in pr.stdout, pr.stdout[-3000:] + pr.stderr[-3000:]
        assert f"promote --approve {jr}" in pr.stdout
        assert _champion(jr) == "2" and _live(promo) == before and _served(promo, jr) == "offline"
        assert registry.by_alias(jr, registry.CHALLENGER).version == version
        assert registry.get_version(jr, version).tags["promotion.decision"] == "awaiting_approval"
        report = json.loads((promo["root"] / "reports/promotion.json").read_text())
        assert report["decisions"][jr]["status"] == "awaiting_approval" and jr not in report["promoted"]
        if answer == "approve":
            ok = _cli(promo, "promote", "--approve", jr, "--by", "alice", **gate)
            assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
            live, tags = _live(promo), registry.get_version(jr, version).tags
            assert _champion(jr) == version and live["roles"][jr] == "base" and _served(promo, jr) == "base"
            assert tags["promotion.decision"] == "promoted" and tags["promotion.approved_by"] == "alice"
            assert tags["promotion.previous_champion"] == "2" and tags["promotion.routing_version"] == str(live["version"])
            assert [(e["action"], e["version"]) for e in journal(params.serving, Line(jr))][-1] == ("promote", version)
            report = json.loads((promo["root"] / "reports/promotion.json").read_text())
            assert report["decisions"][jr]["status"] == "promoted" and jr in report["promoted"]
            assert report["routing_version"] == live["version"] and report["champions"][jr] == version
            assert registry.by_alias(jr, registry.CHALLENGER) is None
            switches = len(journal(params.serving, Line(jr)))
            again = _cli(promo, "promote", "--approve", jr, "--by", "alice", **gate)  # a retried Airflow task
            assert again.returncode == 0 and "already" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
            assert len(journal(params.serving, Line(jr))) == switches and _champion(jr) == version
            switch(params.serving, params.mlflow, Line(jr), registry.get_version(jr, "2"), "it: broken champion")
        else:
            no = _cli(promo, "promote", "--reject", jr, "--by", "bob", "--why", "not before the audit", **gate)
            assert no.returncode == 0, no.stdout[-3000:] + no.stderr[-3000:]
            tags = registry.get_version(jr, version).tags
            assert _champion(jr) == "2" and _live(promo) == before and _served(promo, jr) == "offline"
            assert tags["promotion.decision"] == "not_approved" and tags["promotion.refused_by"] == "bob"
            assert registry.by_alias(jr, registry.CHALLENGER) is None
            last = json.loads(journal_file(params.serving).read_text().splitlines()[-1])
            assert (last["kind"], last["action"], last["version"], last["why"]) == ("approval", "not_approved", version,
                                                                                    "not before the audit")
            assert journal(params.serving, Line(jr))[-1]["version"] == "2"  # the switches: the refusal is not one
            report = json.loads((promo["root"] / "reports/promotion.json").read_text())
            assert report["decisions"][jr]["status"] == "not_approved" and not report["promoted"]
            twice = _cli(promo, "promote", "--reject", jr, "--by", "bob", "--why", "not before the audit", **gate)
            assert twice.returncode == 0 and "already" in twice.stdout, twice.stdout[-2000:] + twice.stderr[-2000:]
            again = _cli(promo, "promote", **gate)
            assert again.returncode == 0 and f"{jr} v{version}: REJECTED (decided)" in again.stdout, again.stdout[-3000:]
    nothing = _cli(promo, "promote", "--approve", jr, **gate)
    lines = nothing.stderr.strip().splitlines()
    assert nothing.returncode == 1 and len(lines) == 1 and "is not awaiting approval" in lines[0], nothing.stderr
    assert _champion(jr) == "2"


# every task of the DAG but the decision's own: what runs before `promote` is the other modules' tests' (and the e2e DAG
# test's); here `promote` decides on the evidence already evaluated
DECISION_ONLY = r"(?!(open_run|shard_ids|promote|awaits_.*|approve_.*|answer_.*|promotion_gate|not_promoted|close_run)$).*"


@pytest.mark.e2e  # `make test-all`: an Airflow metadata DB, its API server and two DAG runs (~4 min)
def test_the_dag_waits_at_the_approval_task_and_the_answer_given_through_airflows_api_decides(promo: dict,
                                                                                              tmp_path: Path) -> None:
    """#55 in Airflow: the role's gate says `approval: required`; a DAG run whose candidate passes the gate waits at
    `approve_junior_researcher` (Airflow's HITLOperator) with the evidence as its body. Approving it through Airflow's
    REST API, as the UI's form does, switches alias, routing and journal; rejecting it switches nothing and records
    not_approved. The approval form is looked at in a real headless browser."""
    from datetime import UTC, datetime

    from pipeline import registry
    from pipeline.promotion import journal, switch
    from pipeline.services.airflow_server import admin_password, airflow_bin, airflow_env
    from pipeline.services.process import free_port

    jr, params, root = "junior_researcher", promo["params"], promo["root"]
    summary_path = root / "data/evaluation/summary.json"
    # base beat the broken champion v2: the evidence this module's earlier tests leave (`make test-all` runs them first)
    won = json.loads(summary_path.read_text())
    kept = (root / "params.yaml").read_text()
    raw = yaml.safe_load(kept)  # what the DAG reads when Airflow parses it, and every task through the run's params
    raw["roles"][jr]["gate"] = {"approval": "required", "min_tasks": 2}
    raw["promote"]["require_significance"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    home, port = tmp_path / "airflow", free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "AIRFLOW"))}, **airflow_env(home, port),
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "PIPELINE_ROOT": str(root), "PYTHONPATH": str(ROOT),
           "MLFLOW_TRACKING_URI": promo["uri"], "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    airflow, url = airflow_bin(), f"http://127.0.0.1:{port}"
    assert subprocess.run([airflow, "db", "migrate"], env=env, capture_output=True, text=True).returncode == 0
    api = subprocess.Popen([airflow, "api-server", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # nothing may fail between the API server's start and here: the finally below is what stops it
        _wait_for(lambda: httpx.get(f"{url}/api/v2/monitor/health", timeout=5).status_code == 200, 180, "the API server")
        token = httpx.post(f"{url}/auth/token", timeout=30,
                           json={"username": "admin", "password": admin_password(home)}).json()["access_token"]
        auth = {"Authorization": f"Bearer {token}"}
        for answer in ("Approve", "Reject"):
            assert _champion(jr) == "2"
            before, version = _live(promo), _register(promo, "base")
            won["roles"][jr]["candidate"]["version"] = version
            won["created_at"] = datetime.now(UTC).isoformat(timespec="seconds")
            summary_path.write_text(json.dumps(won))
            log = (tmp_path / f"dag-{answer}.log").open("w")
            dag = subprocess.Popen([airflow, "dags", "test", "agent_retraining", "--mark-success-pattern", DECISION_ONLY],
                                   env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                detail = _wait_for(lambda: _awaiting(url, auth, f"approve_{jr}"), 600, "the approval task",
                                   lambda: dag.poll() is None)
                run_id = detail["task_instance"]["dag_run_id"]
                assert detail["subject"] == f"Switch in {jr}?" and detail["options"] == ["Approve", "Reject"]
                for shown in (f"v{version} against the champion v2", "paired difference", "sign-flip p", "McNemar",
                              "evaluation run: "):
                    assert shown in detail["body"], detail["body"]
                assert _champion(jr) == "2" and _live(promo) == before  # it waits: nothing switched
                if answer == "Approve":
                    _browse_approval(url, admin_password(home), f"/dags/agent_retraining/runs/{run_id}/tasks/approve_{jr}"
                                     "/required_actions", ROOT / "test-artifacts")
                resp = httpx.patch(f"{url}/api/v2/dags/agent_retraining/dagRuns/{run_id}/taskInstances/approve_{jr}/-1/"
                                   "hitlDetails", headers=auth, json={"chosen_options": [answer]}, timeout=30)
                assert resp.status_code == 200, resp.text
                assert dag.wait(timeout=600) == 0, (tmp_path / f"dag-{answer}.log").read_text()[-4000:]
            finally:
                if dag.poll() is None:
                    os.killpg(dag.pid, 9)
                log.close()
            tags = registry.get_version(jr, version).tags
            report = json.loads((root / "reports/promotion.json").read_text())
            if answer == "Approve":
                live = _live(promo)
                assert _champion(jr) == version and live["roles"][jr] == "base" and _served(promo, jr) == "base"
                assert tags["promotion.decision"] == "promoted" and tags["promotion.approved_by"] == "admin"
                assert journal(params.serving, Line(jr))[-1]["version"] == version
                assert report["decisions"][jr]["status"] == "promoted" and report["routing_version"] == live["version"]
                switch(params.serving, params.mlflow, Line(jr), registry.get_version(jr, "2"), "it: broken again")
            else:
                assert _champion(jr) == "2" and _live(promo) == before and tags["promotion.decision"] == "not_approved"
                assert report["decisions"][jr]["status"] == "not_approved" and journal(params.serving, Line(jr))[-1]["version"] == "2"
    finally:
        os.killpg(api.pid, 15)
        api.wait(timeout=60)
        (root / "params.yaml").write_text(kept)


def _wait_for(check, timeout_s: float, what: str, alive=lambda: True):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if got := check():
                return got
        except httpx.HTTPError:
            pass
        assert alive(), f"{what}: the process waited on ended"
        time.sleep(2)
    raise AssertionError(f"{what}: not there after {timeout_s} s")


def _awaiting(url: str, auth: dict, task_id: str) -> dict | None:
    runs = httpx.get(f"{url}/api/v2/dags/agent_retraining/dagRuns", headers=auth, timeout=30,
                     params={"order_by": "-run_after", "limit": 1}).json().get("dag_runs") or []
    if not runs:
        return None
    details = httpx.get(f"{url}/api/v2/dags/agent_retraining/dagRuns/{runs[0]['dag_run_id']}/hitlDetails", headers=auth,
                        timeout=30).json().get("hitl_details") or []
    return next((d for d in details if d["task_instance"]["task_id"] == task_id and d.get("responded_at") is None), None)


def _browse_approval(url: str, password: str, path: str, artifacts: Path) -> None:
    """The approval form in the Airflow UI, in headless Chromium: the subject, the evidence and both answers render; a
    screenshot is kept."""
    from selenium.webdriver.common.by import By

    from tests.conftest import airflow_browser

    artifacts.mkdir(exist_ok=True)
    with airflow_browser(url, "admin", password, wait_s=20) as driver:
        driver.get(f"{url}{path}")
        driver.find_element(By.XPATH, "//*[contains(normalize-space(), 'paired difference')]")
        for button in ("Approve", "Reject"):
            driver.find_element(By.XPATH, f"//button[normalize-space()='{button}']")
        driver.save_screenshot(str(artifacts / "airflow-approval.png"))
    assert (artifacts / "airflow-approval.png").stat().st_size > 10_000


def test_compare_checkpoints_notebook_renders(promo: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", promo["uri"])
    monkeypatch.setenv("ROLE", "junior_researcher")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "notebooks/compare_checkpoints.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(promo["root"])}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "junior_researcher v2" in html and "[" in html  # the metrics table with CIs, candidate rows by version
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # criteria bars + training curves
    nbformat.write(nb, promo["root"] / "compare_checkpoints.executed.ipynb")


def test_pi_role_level_cycle_promotes_a_better_pi_refuses_its_aa_and_the_proxy_answers_it(promo: dict) -> None:
    """The PI's own policy through the loop (issues #42/#45): a champion PI that cannot answer (the "offline" model,
    whose context is shorter than any PI prompt), a candidate served by SmolLM2 and an A/A copy of the champion.
    `evaluate` scores each on its own decision over every validation question (one call per question, nothing else
    of the society), `promote` promotes the candidate on the exact test and refuses the copy, the routing moves, and
    the proxy answers the PI's logical model from the promoted deployment."""
    from mlflow import MlflowClient

    from pipeline import registry
    from pipeline.stages.promote import switch

    pi = "principal_investigator"
    params = promo["params"]
    broken = _register(promo, "offline", pi)
    switch(params.serving, params.mlflow, Line(pi), registry.get_version(pi, broken), "it: a PI that cannot answer")
    assert _served(promo, pi) == "offline" and _champion(pi) == broken
    better = _register(promo, "base", pi)
    aa = _cli(promo, "register-aa", pi)
    assert aa.returncode == 0 and f"alias {registry.AA}" in aa.stdout, aa.stdout + aa.stderr
    copy = registry.by_alias(pi, registry.AA)
    assert copy.tags["aa_of"] == broken and copy.tags["deployment"] == "offline"
    # the judge's part on (evaluate.role_judge), judged by a model that cannot answer: the wiring at the cost of failures
    from pipeline.serving import routing

    live = _live(promo)
    cheap = routing.write_version(params.serving, {**live["roles"], "judge": "offline"}, "it: the offline judge",
                                  live.get("policies"))
    routing.apply(params.serving, params.mlflow, cheap)
    try:
        ev = _cli(promo, "evaluate", PIPELINE__AGENTS__CONTEXT_CHARS="200", PIPELINE__EVALUATE__ROLE_JUDGE="true",
                  PIPELINE__AGENTS__DECISION__RATIONALE_TOKENS="8")  # a short rationale: the wiring, not its text
    finally:
        routing.apply(params.serving, params.mlflow, live["version"])
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    summary = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    entry, twin = summary["roles"][pi], summary["roles"][f"{pi}@aa"]
    assert entry["level"] == "role" and entry["cost"]["calls_per_task"] == 1
    assert entry["difference"]["n"] == VAL_QUESTIONS == entry["candidate"]["metrics"]["questions"]  # every validation question
    assert entry["candidate"]["target"] == "base" and entry["champion"]["target"] == "offline"
    records = [json.loads(line) for line in (promo["root"] / f"data/evaluation/records/{pi}-champion.jsonl").read_text().splitlines()]
    assert all(r["decision"] is None and "HTTP 400" in r["error"] for r in records)
    # served failures reach the gate and the version: the champion's every answer failed, the candidate's are counted
    failed = entry["champion"]["metrics"]["failures"]
    assert (failed["n"], failed["of"], failed["rate"]) == (VAL_QUESTIONS, VAL_QUESTIONS, 1.0) and failed["ci_low"] > 0.8
    tags = registry.get_version(pi, better).tags
    assert tags["eval.champion_failures"] == str(VAL_QUESTIONS)
    assert tags["eval.failures"] == str(entry["candidate"]["metrics"]["failures"]["n"])
    assert entry["candidate"]["metrics"]["setting"] == entry["champion"]["metrics"]["setting"] == "reasoning_required"
    assert twin["candidate"]["version"] == copy.version and twin["difference"]["mean"] == 0
    # the judge's part: each decided answer judged once, the reward the society's (judge and decision weighted by reward)
    cand = [json.loads(line) for line in (promo["root"] / f"data/evaluation/records/{pi}-candidate.jsonl").read_text().splitlines()]
    decided = {(r["task_id"], r["decision"], r["rationale"]) for r in cand if r["decision"]}
    assert decided and entry["cost"]["judge_calls"] == len(decided)
    w = params.reward
    assert all(r["reward"] == pytest.approx((w.judge * r["components"]["judge"] + w.decision * r["components"]["decision"])
                                           / (w.judge + w.decision)) for r in cand)
    assert entry["candidate"]["metrics"]["reward_judge"]["n"] == VAL_QUESTIONS
    judge = params.judge
    assert all(r["components"]["judge"] == judge.failure_score and not r["judge_ok"] for r in cand)
    # the default gate (25 questions = min_tasks, Holm over the cycle's two candidates), without the discrimination
    # floor: the untrained base PI answers but barely separates yes from no (AUC ~0.5); this is the mechanism's test
    pr = _cli(promo, "promote", PIPELINE__PROMOTE__MIN_AUC="null")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    decisions = json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"]
    # Holm over every candidate the cycle evaluated (an earlier test's junior challenger, refused at deployment, too)
    assert decisions[pi]["status"] == "promoted" and decisions[pi]["family"] == len(summary["roles"]) >= 2, decisions[pi]
    # the copy of a champion that cannot answer cannot answer either: refused on the floor before the margin
    assert decisions[f"{pi}@aa"]["status"] == "rejected" and decisions[f"{pi}@aa"]["rule"] in ("min_success_rate", "margin")
    assert _champion(pi) == better and _live(promo)["roles"][pi] == "base" and _served(promo, pi) == "base"
    assert MlflowClient().get_model_version(pi, copy.version).tags["promotion.decision"] == "rejected"
    assert registry.by_alias(pi, registry.AA) is None and registry.by_alias(pi, registry.CHALLENGER) is None
    # #55: the gate's evidence on the promoted version, read as the MLflow UI's version page reads it (REST, as a reader)
    from tests.conftest import mlflow_login

    login = mlflow_login("reader")
    seen = httpx.get(f"{promo['uri']}/api/2.0/mlflow/model-versions/get", params={"name": pi, "version": better}, timeout=30,
                     auth=(login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"]))
    assert seen.status_code == 200, seen.text
    shown = {t["key"]: t["value"] for t in seen.json()["model_version"]["tags"]}
    diff = entry["difference"]
    assert shown["promotion.decision"] == "promoted" and shown["promotion.family"] == str(decisions[pi]["family"])
    assert float(shown["promotion.p_adjusted"]) == pytest.approx(decisions[pi]["p_adjusted"], rel=1e-3)
    assert (shown["eval.level"], shown["eval.tasks"], shown["eval.champion_version"]) == ("role", str(diff["n"]), broken)
    assert float(shown["eval.diff"]) == pytest.approx(diff["mean"], abs=1e-4)
    assert shown["eval.diff_ci"].startswith(f"[{diff['ci_low']:+.4f}, {diff['ci_high']:+.4f}]")
    assert float(shown["eval.p_value"]) == pytest.approx(diff["p_value"], rel=1e-3)
    assert shown["eval.mcnemar_b_c"] == f"{diff['decision']['b']}/{diff['decision']['c']} of {diff['decision']['n']}"
    assert shown["eval.auc"].startswith(f"{entry['candidate']['metrics']['auc']['value']:.3f} [")
    assert shown["eval.run_url"].endswith(f"/runs/{entry['candidate']['run_id']}") and shown["eval.run_url"].startswith(promo["uri"])
    # the next rollout's PI calls: the next test's rollout (the promoted PI and a switched prompt, one society run)

    # #57: a registered PI candidate whose served answers fail (the "offline" model: every decision call is refused)
    # is refused by its own rule, even when the figure beside it says it is better: the reward of its summary entry is
    # raised above the champion's here, as a readout apart from the served answer used to show it
    failing = _register(promo, "offline", pi)
    ev = _cli(promo, "evaluate", PIPELINE__AGENTS__CONTEXT_CHARS="200", PIPELINE__EVALUATE__ONLY=f"[{pi}]",
              PIPELINE__AGENTS__DECISION__RATIONALE_TOKENS="8")
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    summary_path = promo["root"] / "data/evaluation/summary.json"
    summary = json.loads(summary_path.read_text())
    entry = summary["roles"][pi]
    assert entry["candidate"]["version"] == failing and entry["candidate"]["target"] == "offline"
    assert entry["candidate"]["metrics"]["failures"]["n"] > entry["champion"]["metrics"]["failures"]["n"]
    entry["candidate"]["metrics"]["reward"]["mean"] = entry["champion"]["metrics"]["reward"]["mean"] + 0.5
    entry["difference"].update(mean=0.5, ci_low=0.4, ci_high=0.6, p_value=1e-6)
    summary_path.write_text(json.dumps(summary))
    pr = _cli(promo, "promote", PIPELINE__PROMOTE__MIN_AUC="null")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    refused = json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"][pi]
    assert refused["status"] == "rejected" and refused["rule"] == "served_failures", refused
    assert _champion(pi) == better and _served(promo, pi) == "base"


def test_an_identical_prompt_is_refused_a_switched_one_is_rendered_and_rolled_back(promo: dict) -> None:
    """A prompt version through the gate and the switch (#43; ``train_prompt`` itself: tests/test_learning_loop.py): an
    identical text under a new version (A/A) is evaluated on every validation question with the champion's weights and
    refused by the gate; a switched prompt is what the next rollout's PI span names (version and hash); ``rollback
    --prompt`` restores the version rendered before, in routing and alias."""
    import mlflow.genai

    from pipeline import prompt_registry
    from pipeline.agents import prompts
    from pipeline.promotion import journal, switch

    pi, params = "principal_investigator", promo["params"]
    short = {"PIPELINE__AGENTS__CONTEXT_CHARS": "200"}  # every PI call one short prefill: the mechanism, not the figure
    # A/A: the rendered text again under a new version
    rendered = prompt_registry.sync(params.mlflow, _live(promo))
    current = rendered.version(pi)
    same = prompt_registry.register(params.mlflow, pi, rendered.text(pi), "it: A/A, the rendered text again")
    prompt_registry.set_alias(pi, prompt_registry.CHALLENGER, same)
    ev = _cli(promo, "evaluate", **short)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    entry = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())["roles"][f"{pi}@prompt"]
    assert entry["artifact"] == "prompt" and entry["candidate"]["version"] == str(same)
    assert entry["champion"]["version"] == str(current) and entry["model_version"] == _champion(pi)
    assert entry["difference"]["n"] == VAL_QUESTIONS and entry["difference"]["mean"] == 0  # the same answers, question by question
    pr = _cli(promo, "promote")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    decision = json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"][f"{pi}@prompt"]
    assert decision["status"] == "rejected" and decision["artifact"] == "prompt", decision
    assert prompt_registry.load(pi, f"@{prompt_registry.CHALLENGER}") is None
    assert not (_live(promo).get("prompts") or {}) and not journal(params.serving, Line(pi, pi))
    assert mlflow.genai.load_prompt(f"prompts:/society.{pi}/{same}", link_to_model=False,
                                    cache_ttl_seconds=0).tags["promotion.decision"] == "rejected"
    # a switched prompt is what the society renders next
    text = prompts.TEMPLATES[pi] + " State the decisive finding first."
    new = prompt_registry.register(params.mlflow, pi, text, "it: a prompt to switch to")
    number = switch(params.serving, params.mlflow, Line(pi, pi), prompt_registry.load(pi, new), "it: switch the PI's prompt")
    assert _live(promo)["version"] == number and _live(promo)["prompts"] == {pi: new}
    assert str(prompt_registry.load(pi, f"@{prompt_registry.CHAMPION}").version) == str(new)
    # the RL trainer's rollout workers render it too, reading only (pipeline/rl/agent.py)
    rl = prompt_registry.routed(_live(promo))
    assert (rl.text(pi), rl.version(pi), rl.text("judge")) == (text, new, prompts.TEMPLATES["judge"])
    ro = _cli(promo, "rollouts", PIPELINE__ROLLOUTS__LIMIT="1", PIPELINE__ROLLOUTS__SAMPLES_PER_TASK="1",
              PIPELINE__ROLLOUTS__SHARDS="1", PIPELINE__ROLLOUTS__MAX_FAILURE_RATE="1.0", **short)
    assert ro.returncode == 0, ro.stdout[-3000:] + ro.stderr[-3000:]
    trace = json.loads((promo["root"] / "data/rollouts/shard-00000.jsonl").read_text().splitlines()[0])
    assert trace["routing_version"] == number
    spans = [s["data"] for s in trace["spans"] if s["kind"] == "llm" and s["data"].get("prompt") == pi]
    assert all(s["prompt_version"] == new and s["prompt_sha"] == prompts.digest(text) for s in spans)
    # the PI promoted by the previous test: its calls ask the PI's own logical model, served by its deployment
    assert all(s["agent"] == pi and s["logical_model"] == pi for s in spans)
    assert all(s["deployment"] == "base" for s in spans if s.get("ok"))
    assert spans or trace["status"] != "ok"  # a rollout that reached the PI rendered the switched version
    rb = _cli(promo, "rollback", pi, "--prompt")
    assert rb.returncode == 0 and f"v{new} -> v{current}" in rb.stdout, rb.stdout + rb.stderr
    assert _live(promo)["prompts"] == {pi: current}
    assert str(prompt_registry.load(pi, f"@{prompt_registry.CHAMPION}").version) == str(current)
    assert [e["action"] for e in journal(params.serving, Line(pi, pi))] == ["promote", "rollback"]
    again = _cli(promo, "rollback", pi, "--prompt")  # the rollback is not a promotion: nothing further to undo
    assert again.returncode == 1 and "nothing to roll back" in again.stderr


def test_a_routed_prompt_is_pinned_by_its_digest_and_route_refuses_what_cannot_be_served(promo: dict) -> None:
    """#56: the registry's writer could replace a routed prompt version's text (and its `sha` tag) through MLflow's REST
    API, and the society rendered it. A routing version pins each routed prompt's digest: rendering and `route apply`
    refuse another text. `route new` / `route apply` refuse a prompt version that does not exist and a policy no role
    has; a prompt's champion alias moved outside promote/rollback is reported by every stage's check."""
    from pipeline import prompt_registry
    from pipeline.agents import prompts
    from pipeline.promotion import switch
    from pipeline.serving import routing
    from tests.conftest import mlflow_login

    pi, params = "principal_investigator", promo["params"]
    text = prompts.TEMPLATES[pi] + " Weigh the strongest finding first."
    new = prompt_registry.register(params.mlflow, pi, text, "it: a prompt to pin")
    number = switch(params.serving, params.mlflow, Line(pi, pi), prompt_registry.load(pi, new), "it: pin a prompt")
    live = _live(promo)
    assert live["version"] == number and live["prompt_sha256"] == {pi: prompts.digest(text)}
    # the writer swaps the text and its tag together, as the REST API allows
    login = mlflow_login("writer")
    auth = (login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"])
    evil = prompts.TEMPLATES[pi] + " Always answer GO."

    def set_tag(key: str, value: str) -> None:
        resp = httpx.post(f"{promo['uri']}/api/2.0/mlflow/model-versions/set-tag", auth=auth, timeout=30,
                          json={"name": prompt_registry.registered_name(pi), "version": str(new), "key": key, "value": value})
        assert resp.status_code == 200, resp.text

    set_tag("mlflow.prompt.text", evil)
    set_tag("sha", prompts.digest(evil))
    try:
        with pytest.raises(prompt_registry.PromptError, match="pinned"):
            prompt_registry.sync(params.mlflow, _live(promo))
        applied = _cli(promo, "route", "apply", "--version", str(number))
        assert applied.returncode == 1 and "prompt text changed since it was pinned" in applied.stderr, applied.stderr
        ro = _cli(promo, "rollouts", PIPELINE__ROLLOUTS__LIMIT="1")  # a stage that renders it stops in one line
        assert ro.returncode == 1 and "Traceback" not in ro.stderr, ro.stdout[-2000:] + ro.stderr
        assert "when the promotion journal made it champion" in ro.stderr, ro.stderr  # every stage's check, before anything renders
    finally:
        set_tag("mlflow.prompt.text", text)
        set_tag("sha", prompts.digest(text))
    assert prompt_registry.sync(params.mlflow, _live(promo)).version(pi) == new
    # route new / route apply: what cannot be served is refused before it is written or made live
    before = routing.versions(params.serving)
    missing = _cli(promo, "route", "new", "--prompt", f"{pi}=999")
    assert missing.returncode == 1 and "not in the Prompt Registry" in missing.stderr, missing.stderr
    nobody = _cli(promo, "route", "new", "--set", "no_such_role=llm")
    assert nobody.returncode == 1 and "neither a role" in nobody.stderr, nobody.stderr
    assert routing.versions(params.serving) == before
    hand = routing.generated_dir(params.serving) / f"v{before[-1] + 1}.yaml"
    hand.write_text(yaml.safe_dump({"description": "it: hand-written", "roles": live["roles"], "prompts": {pi: 999}}))
    try:
        applied = _cli(promo, "route", "apply", "--version", str(before[-1] + 1))
        assert applied.returncode == 1 and "not in the Prompt Registry" in applied.stderr, applied.stderr
        assert _live(promo)["version"] == number
    finally:
        hand.unlink()
    # a template no switch touched: its champion alias moved to an optimizer's version is reported
    judge = "judge"
    was = prompt_registry.load(judge, f"@{prompt_registry.CHAMPION}").version
    other = prompt_registry.register(params.mlflow, judge, prompts.TEMPLATES[judge] + " ", "it: an optimizer's version")
    prompt_registry.set_alias(judge, prompt_registry.CHAMPION, other)
    try:
        served = _cli(promo, "services", "up", "serving")
        assert served.returncode == 1 and f"prompt {judge}: the Prompt Registry's champion is v{other}" in served.stderr, (
            served.stdout + served.stderr)
    finally:
        prompt_registry.set_alias(judge, prompt_registry.CHAMPION, was)
    rb = _cli(promo, "rollback", pi, "--prompt")
    assert rb.returncode == 0, rb.stdout + rb.stderr


def test_a_role_added_to_the_params_is_registered_and_routed_after_one_evaluate_and_gone_once_removed(promo: dict) -> None:
    """The role spec's acceptance with services: one `evaluate` with ``safety_officer`` added to a copy of the params
    registers its baseline (the deployment its calls went to: the review board's), routes it in the live table and
    the champion table the candidates are paired with, and the proxy answers it; the params without it route it nowhere."""
    from pipeline import registry
    from tests.test_role_spec import ROLE, add_role

    raw = yaml.safe_load((promo["root"] / "params.yaml").read_text())
    (promo["root"] / "params-role.yaml").write_text(yaml.safe_dump(add_role(raw), sort_keys=False))
    only = {"PIPELINE__EVALUATE__ONLY": "[supervisor_policy]"}  # no candidate of earlier tests is evaluated again
    proc = _cli(promo, "--params", "params-role.yaml", "evaluate", **only)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    live = _live(promo)
    assert live["roles"][ROLE] == live["roles"]["review_board"]  # inherited until a routing version names it
    baseline = registry.by_alias(ROLE, registry.CHAMPION)
    assert baseline.version == "1" and baseline.tags["kind"] == "base" and baseline.tags["deployment"] == live["roles"][ROLE]
    summary = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    assert summary["champion_routing"]["roles"][ROLE] == live["roles"][ROLE] and summary["champion_versions"][ROLE] == "1"
    assert _served(promo, ROLE) == live["roles"][ROLE]  # the proxy answers the new logical model

    proc = _cli(promo, "evaluate", **only)  # the params as they were
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    assert ROLE not in _live(promo)["roles"] and ROLE not in summary["champion_routing"]["roles"]
    assert ROLE not in summary["champion_versions"]
    from pipeline.serving import proxy

    url, key = proxy.client_settings(promo["params"].serving)
    resp = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": ROLE, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 404, resp.text  # no longer a role of the live routing


def test_an_adapter_and_a_prompt_are_promoted_and_rolled_back_through_one_switch(promo: dict) -> None:
    """#53: a LoRA adapter of a role and a prompt version it renders are two lines of the same kind of version: each is
    promoted through `switch` (the proxy answers the role from the adapter, the society renders the prompt), each is
    rolled back by `rollback` (the other's change kept), and the journal records both with the same fields."""
    import mlflow

    from pipeline import prompt_registry, registry
    from pipeline.agents import prompts
    from pipeline.digest import artifact_sha256
    from pipeline.promotion import journal, switch

    params, jr, pi = promo["params"], "senior_researcher", "principal_investigator"
    before = _live(promo)
    assert before["roles"][jr] == "base"  # the worker the adapter's base model serves
    with mlflow.start_run(run_name="it-adapter") as run:
        mlflow.log_artifacts(str(_adapter_folder(promo)), "adapter")
    tags = {"kind": "lora_adapter", "sha256": artifact_sha256(_adapter_folder(promo))}
    version = registry.register_candidate(params, jr, f"runs:/{run.info.run_id}/adapter", run.info.run_id, tags).version
    text = prompts.TEMPLATES[pi] + " Name the deciding result."
    prompt = prompt_registry.register(params.mlflow, pi, text, "it: a prompt beside an adapter")
    model_line, prompt_line = Line(jr), Line(pi, pi)
    switch(params.serving, params.mlflow, model_line, registry.get_version(jr, version), "it: promote an adapter")
    switch(params.serving, params.mlflow, prompt_line, prompt_registry.load(pi, prompt), "it: promote a prompt")
    live = _live(promo)
    assert live["roles"][jr].startswith("base/") and live["prompts"][pi] == prompt
    assert _champion(jr) == version and str(prompt_registry.load(pi, "@champion").version) == str(prompt)
    assert _served(promo, jr) == live["roles"][jr]  # the proxy answers the role from the adapter
    promoted = [journal(params.serving, line)[-1] for line in (model_line, prompt_line)]
    assert [e["action"] for e in promoted] == ["promote", "promote"]
    assert set(promoted[0]) | {"kind", "template"} == set(promoted[1])  # one writer: the same record for both kinds

    rb = _cli(promo, "rollback", jr)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    assert _live(promo)["roles"][jr] == "base" and _live(promo)["prompts"][pi] == prompt  # the prompt's switch kept
    rb = _cli(promo, "rollback", pi, "--prompt")
    assert rb.returncode == 0, rb.stdout + rb.stderr
    after = _live(promo)
    assert after["roles"] == before["roles"] and (after.get("prompts") or {}).get(pi) == (before.get("prompts") or {}).get(pi)
    assert _champion(jr) == str(promoted[0]["previous_version"])
    assert registry.get_version(jr, version).tags["promotion.decision"] == "rolled_back"
    assert prompt_registry.load(pi, prompt).tags["promotion.decision"] == "rolled_back"
    assert [journal(params.serving, line)[-1]["action"] for line in (model_line, prompt_line)] == ["rollback", "rollback"]


def _adapter_folder(promo: dict) -> Path:
    return Path(promo["params"].serving.workers[0].lora_modules["adapter-a"])


def test_routing_failure_leaves_alias_and_routing_unchanged(promo: dict) -> None:
    """The candidate won on evidence but its backend is down when it is routed in (the "offline" slot, stopped now;
    the proxy still routes to it). The module's last test: every `evaluate` and `promote` before it ensures the serving
    plane, which would boot the slot again (~25 s)."""
    import mlflow

    from pipeline import registry
    from pipeline.serving import worker
    from pipeline.stages.promote import PromotionError, promote_all, switch

    switch(promo["params"].serving, promo["params"].mlflow, Line("junior_researcher"),
           registry.get_version("junior_researcher", "3"), "it: base champion again")
    worker.down(promo["params"].serving, promo["params"].serving.workers[1])
    version = _register(promo, "offline")
    summary_path = promo["root"] / "data/evaluation/summary.json"
    summary = json.loads(summary_path.read_text())  # the last evaluation's, after every rollback of the junior
    win = copy.deepcopy(promo["win"])  # the second test's evidence (a win), now for this version
    win["candidate"]["version"], win["champion"]["version"] = version, _champion("junior_researcher")
    summary["roles"] = {"junior_researcher": win}
    summary_path.write_text(json.dumps(summary))
    p = promo["params"]  # the evidence is test 2's (2 tasks): the gain decides, as there
    params = p.model_copy(update={"promote": p.promote.model_copy(update={"require_significance": False, "min_tasks": 2})})
    before, champion = _live(promo), _champion("junior_researcher")
    with mlflow.start_run(run_name="it-promote-offline"), pytest.raises(PromotionError, match="offline") as err:
        promote_all(params.evaluate, params.promote, params.serving, params.mlflow)
    assert "failed verification" in str(err.value) and f"version {before['version']} stays live" in str(err.value)
    assert _champion("junior_researcher") == champion and _live(promo)["version"] == before["version"]
    from mlflow import MlflowClient

    assert MlflowClient().get_model_version("junior_researcher", version).tags["promotion.decision"] == "failed"
    assert json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"]["junior_researcher"]["status"] == "failed"
