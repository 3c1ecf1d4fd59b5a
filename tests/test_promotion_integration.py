"""Judge-gated promotion for real (slow): registry, evaluation on the validation split through an
evaluation routing, the gate, routing on promotion, a failed promotion, rollback.

SmolLM2 behind the session's shared serving stack, its own MLflow server (the registry must start
empty here). The "degraded" junior is a LoRA adapter with random weights at a large scale: it cannot
write a hypothesis, so the rollouts it takes part in fail and score 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from pipeline.config import Params, load_params
from pipeline.envs import model_python
from tests.conftest import PUBMEDQA, ROOT

pytestmark = pytest.mark.slow

DEGRADE = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
peft = get_peft_model(model, cfg)
with torch.no_grad():  # noise in every layer: the model's tokens are random, its JSON strings never close
    for name, param in peft.named_parameters():
        if "lora_" in name:
            param.normal_(0.0, 1.0)
peft.save_pretrained(sys.argv[2])
"""
SMALL = {"agents": {"max_review_rounds": 0, "max_tool_calls": 0, "max_tokens": 128, "json_retries": 1}, "rollouts": {"retries": 0},
         "evaluate": {"limit": 2, "bootstrap": 200}, "report": {"limit": 2}}


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


@pytest.fixture(scope="module")
def promo(serving_stack: Params, serving_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from pipeline import tracking
    from pipeline.services import mlflow_server
    from pipeline.services.process import free_port
    from pipeline.serving import routing
    from pipeline.stages import build_index, ingest, validate

    root = tmp_path_factory.mktemp("promotion")
    raw = _merge(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL)
    raw["data"].update(source=str(PUBMEDQA / "ori_pqal.json"), test_ids=str(PUBMEDQA / "test_ground_truth.json"))
    s = serving_stack.serving
    # only the running worker: every stage brings up each configured local worker (the "offline" one
    # is added in the routing-failure test, in-process, where nothing starts workers)
    raw["serving"].update(home=s.home, routing_dir=s.routing_dir, proxy=s.proxy.model_dump(), workers=[s.workers[0].model_dump()])
    raw["mlflow"].update(home=str(root / "mlflow"), port=free_port(), experiment="promotion-it")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    saved_cwd, saved_uri = os.getcwd(), os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.chdir(root)
    env_keys = [k for k in os.environ if k.startswith("PIPELINE__")]
    saved_env = {k: os.environ.pop(k) for k in env_keys}
    params = load_params(root / "params.yaml")
    try:
        ingest.run(params)
        validate.run(params)
        build_index.run(params)
        routing.apply(params, 1)
        uri = tracking.setup(params)
        degraded = root / "degraded"
        subprocess.run([model_python(), "-c", DEGRADE, str(serving_models / "base"), str(degraded)], check=True, capture_output=True)
        yield {"root": root, "params": params, "uri": uri, "degraded": degraded, "all_workers": [w.model_dump() for w in s.workers]}
    finally:
        routing.apply(params, 1)
        mlflow_server.down(params)
        os.chdir(saved_cwd)
        os.environ.update(saved_env)
        if saved_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved_uri


def _cli(promo: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")}, "PYTHONPATH": str(ROOT),
           "MLFLOW_TRACKING_URI": promo["uri"], "PIPELINE_RUN_ID": "promotion-it", **extra}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=promo["root"], env=env, capture_output=True, text=True)


def _register(promo: dict, tags: dict[str, str], adapter: Path | None = None) -> str:
    """A new junior_researcher version as a trainer registers it (challenger)."""
    import mlflow

    from pipeline import registry

    with mlflow.start_run(run_name="it-candidate") as run:
        if adapter is not None:
            mlflow.log_artifacts(str(adapter), artifact_path="adapter")
    source = f"runs:/{run.info.run_id}/adapter" if adapter is not None else f"runs:/{run.info.run_id}"
    return registry.register_candidate(promo["params"], "junior_researcher", source, run.info.run_id, tags).version


def _live(promo: dict) -> dict:
    from pipeline.serving import routing

    return routing.active(promo["params"])


def _served(promo: dict, role: str) -> str:
    from pipeline.serving import proxy

    url, key = proxy.client_settings(promo["params"])
    resp = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"model": role, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-litellm-model-group"]


def _champion(name: str) -> str:
    from pipeline import registry

    return registry.by_alias(name, registry.CHAMPION).version


def test_worse_candidate_is_not_promoted(promo: dict) -> None:
    from mlflow import MlflowClient

    version = _register(promo, {"kind": "lora_adapter"}, promo["degraded"])
    assert version == "2" and _champion("junior_researcher") == "1"  # v1: the baseline, registered on first use
    assert MlflowClient().get_model_version("junior_researcher", "1").tags["kind"] == "base"
    before = _live(promo)
    ev = _cli(promo, "evaluate")
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    summary = json.loads((promo["root"] / "data/evaluation/summary.json").read_text())
    entry = summary["roles"]["junior_researcher"]
    assert entry["candidate"]["target"] == "base/junior_researcher-v2" and len(summary["tasks"]) == 2
    assert entry["difference"]["n"] == 2 and entry["champion"]["metrics"]["tasks"] == 2
    pr = _cli(promo, "promote")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    assert "junior_researcher v2: REJECTED (min_success_rate)" in pr.stdout, pr.stdout  # the noise adapter never completes a rollout
    assert _champion("junior_researcher") == "1" and _live(promo) == before
    tags = MlflowClient().get_model_version("junior_researcher", "2").tags
    assert tags["promotion.decision"] == "rejected" and tags["promotion.rule"] and "eval.diff_ci" in tags
    # the evaluation is browsable as MLflow GenAI evaluation: per-question traces carry the judge's scores
    import mlflow

    traces = mlflow.search_traces(run_id=entry["candidate"]["run_id"], return_type="list")
    assert len(traces) == 2 and {"reward", "groundedness", "pubmedqa_answer"} <= {a.name for a in traces[0].info.assessments}
    assert (promo["root"] / "reports/plots/evaluate.png").stat().st_size > 0


def test_better_candidate_is_promoted_then_rolled_back(promo: dict) -> None:
    from mlflow import MlflowClient

    from pipeline import registry
    from pipeline.stages.promote import switch

    # a random-weight champion: the degraded adapter, put in place the way a promotion does
    switch(promo["params"], "junior_researcher", registry.get_version("junior_researcher", "2"), "it: degraded champion")
    assert _served(promo, "junior_researcher") == "base/junior_researcher-v2"
    version = _register(promo, {"kind": "base", "deployment": "base"})
    ev = _cli(promo, "evaluate")
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    # two questions cannot make a paired CI exclude 0 when SmolLM2 fails one; the significance rule is
    # unit-tested (test_promotion_gate.py), here the gain over a champion that scores 0 decides
    pr = _cli(promo, "promote", PIPELINE__PROMOTE__REQUIRE_SIGNIFICANCE="false")
    assert pr.returncode == 0, pr.stdout[-3000:] + pr.stderr[-3000:]
    assert f"junior_researcher v{version}: PROMOTED" in pr.stdout, pr.stdout
    assert _champion("junior_researcher") == version
    assert _live(promo)["roles"]["junior_researcher"] == "base" and _served(promo, "junior_researcher") == "base"
    tags = MlflowClient().get_model_version("junior_researcher", version).tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.previous_champion"] == "2"
    report = json.loads((promo["root"] / "reports/promotion.json").read_text())
    assert report["promoted"] == ["junior_researcher"] and report["routing_version"] == _live(promo)["version"]

    rb = _cli(promo, "rollback", "junior_researcher")
    assert rb.returncode == 0, rb.stdout + rb.stderr
    assert _champion("junior_researcher") == "2" and _served(promo, "junior_researcher") == "base/junior_researcher-v2"


def test_routing_failure_leaves_alias_and_routing_unchanged(promo: dict) -> None:
    """The candidate won on evidence but its backend is down when it is routed in: the stack's
    "offline" worker, which the proxy knows and nothing started."""
    import mlflow

    from pipeline.stages.promote import PromotionError, promote_all

    version = _register(promo, {"kind": "base", "deployment": "offline"})
    summary_path = promo["root"] / "data/evaluation/summary.json"
    summary = json.loads(summary_path.read_text())
    summary["roles"]["junior_researcher"]["candidate"]["version"] = version
    summary["roles"]["junior_researcher"]["champion"]["version"] = _champion("junior_researcher")
    summary_path.write_text(json.dumps(summary))  # the last evaluation's evidence (a win), now for this version
    raw = yaml.safe_load((promo["root"] / "params.yaml").read_text())
    raw["serving"]["workers"] = promo["all_workers"]
    (promo["root"] / "params-offline.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(promo["root"] / "params-offline.yaml")
    before, champion = _live(promo), _champion("junior_researcher")
    with mlflow.start_run(run_name="it-promote-offline"), pytest.raises(PromotionError, match="offline") as err:
        promote_all(params)
    assert "failed verification" in str(err.value) and f"version {before['version']} stays live" in str(err.value)
    assert _champion("junior_researcher") == champion and _live(promo)["version"] == before["version"]
    from mlflow import MlflowClient

    assert MlflowClient().get_model_version("junior_researcher", version).tags["promotion.decision"] == "failed"
    assert json.loads((promo["root"] / "reports/promotion.json").read_text())["decisions"]["junior_researcher"]["status"] == "failed"


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
