"""A role is one entry of the params: added there, it is everywhere the loop lists roles; removed, it is nowhere.

The role added is ``safety_officer``, carved out of the review board (its own logical model, its calls routed where the
review board's went until a routing version names it) and learning by SFT: one edit of a copy of ``params.yaml``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_params
from pipeline.runs import outputs
from tests.conftest import ROOT, copy_project

ROLE = "safety_officer"


def add_role(raw: dict) -> dict:
    """The one edit: the role's spec (its agent taken from the review board) and its entry under the SFT kind."""
    raw["roles"]["review_board"]["agents"] = ["peer_reviewer"]
    raw["roles"][ROLE] = {"agents": ["safety_officer"], "evaluation": "society", "inherits": "review_board", "gate": {}}
    raw["sft"]["roles"][ROLE] = {"out_dir": f"models/sft/{ROLE}"}
    return raw


def _dvc_stages(root: Path) -> list[str]:
    return subprocess.run([sys.executable, "-m", "dvc", "stage", "list", "--name-only"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.split()


def _dag_training(root: Path) -> dict:
    """The DAG as Airflow parses it from ``root`` (DagBag): each training task's mapped roles, and the DVC stages it
    commits."""
    code = """
import json, os
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
from airflow.models.dagbag import DagBag
bag = DagBag(dag_folder=os.path.join(os.environ["PIPELINE_ROOT"], "dags"))
assert not bag.import_errors, bag.import_errors
dag = bag.dags["agent_retraining"]
import agent_retraining
print(json.dumps({"tasks": {t.task_id: t.op_kwargs_expand_input.value["role"] for t in dag.task_group_dict["train"].children.values()},
                  "upstream": sorted(dag.get_task("evaluate").upstream_task_ids), "stages": agent_retraining.STAGES}))
"""
    env = {**os.environ, "PIPELINE_ROOT": str(root), "PYTHONPATH": f"{root}:{root / 'dags'}",
           "AIRFLOW_HOME": str(root / ".airflow")}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two copies of the project: the params as they are, and with the role added."""
    plain = copy_project(tmp_path_factory.mktemp("plain") / "proj")
    added = copy_project(tmp_path_factory.mktemp("added") / "proj")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    (added / "params.yaml").write_text(yaml.safe_dump(add_role(raw), sort_keys=False))
    return plain, added


def test_an_added_role_is_a_dvc_stage_a_dag_task_a_registered_and_served_model(copies: tuple[Path, Path]) -> None:
    plain, added = copies
    assert f"train_sft@{ROLE}" in _dvc_stages(added)
    dag = _dag_training(added)
    assert dag["tasks"]["train_sft"] == ["junior_researcher", ROLE]  # one mapped instance per role
    assert f"train_sft@{ROLE}" in dag["stages"] and "train_sft" in dag["upstream"]
    params = load_params(added / "params.yaml", environ={})
    assert params.promote.roles[ROLE] == "llm"  # a registered model of its own: its baseline, its gate
    assert ROLE in params.serving.roles and params.serving.inherits[ROLE] == "review_board"
    assert params.agents.models["safety_officer"] == ROLE and params.agents.models["peer_reviewer"] == "review_board"
    assert params.sft.at(ROLE).out_dir == f"models/sft/{ROLE}"
    summary = outputs(params)  # `make run`'s closing summary: its stage's outputs, registered and served
    assert any(line.split()[:2] == [f"train_sft@{ROLE}", f"models/sft/{ROLE}/"] for line in summary), summary
    assert all(ROLE in line for line in summary if line.split()[0] in ("registry", "serving")), summary


def test_without_the_entry_the_role_is_nowhere(copies: tuple[Path, Path]) -> None:
    plain, _ = copies
    assert not [s for s in _dvc_stages(plain) if ROLE in s]
    dag = _dag_training(plain)
    assert dag["tasks"]["train_sft"] == ["junior_researcher"] and not [s for s in dag["stages"] if ROLE in s]
    params = load_params(plain / "params.yaml", environ={})
    assert ROLE not in params.promote.roles and ROLE not in params.serving.roles
    assert params.agents.models["safety_officer"] == "review_board"
    assert not [line for line in outputs(params) if ROLE in line]


def test_a_role_that_names_an_agent_twice_or_learns_as_the_instrument_is_refused(tmp_path: Path) -> None:
    from pipeline.config import ParamsError

    raw = add_role(yaml.safe_load((ROOT / "params.yaml").read_text()))
    raw["roles"]["review_board"]["agents"] = ["peer_reviewer", "safety_officer"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"roles\.safety_officer\.agents: safety_officer is already answered by "
                                          r"roles\.review_board"):
        load_params(tmp_path / "p.yaml", environ={})
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["sft"]["roles"]["judge"] = {"out_dir": "models/sft/judge"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"sft\.roles\.judge: roles\.judge is the instrument"):
        load_params(tmp_path / "p.yaml", environ={})
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["promote"]["roles"] = {"junior_researcher": "llm"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"promote\.roles: derived from roles"):
        load_params(tmp_path / "p.yaml", environ={})


def test_a_role_given_a_grpo_policy_by_one_params_entry_trains_on_its_own_agents_prompts(tmp_path: Path) -> None:
    """``review_board`` learns by GRPO: one entry under ``ppo.roles``. It is then a DVC stage and a mapped DAG task, a
    registered model with its own gate, and the datasets stage gives its trainer its own agents' prompts, each with the
    schema the society decoded it under (the grammar GRPO samples with, the schema its reward grades)."""
    import asyncio

    from pipeline.rewards import completion
    from pipeline.stages import datasets
    from tests.test_datasets import trace

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["ppo"]["roles"]["review_board"] = {"out_dir": "models/ppo/review_board", "agents": ["peer_reviewer", "safety_officer"]}
    root = copy_project(tmp_path / "proj")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert "train_ppo@review_board" in _dvc_stages(root)
    dag = _dag_training(root)
    assert dag["tasks"]["train_ppo"] == ["senior_researcher", "review_board"] and "train_ppo@review_board" in dag["stages"]
    params = load_params(root / "params.yaml", environ={})
    assert params.promote.roles["review_board"] == "llm" and params.ppo.at("review_board").agents == ["peer_reviewer",
                                                                                                          "safety_officer"]
    assert datasets.rl_agents(params) == {"hypothesis_refiner": "senior_researcher", "peer_reviewer": "review_board",
                                          "safety_officer": "review_board"}

    from pipeline.traces.adapters import Drops, Trace, rl_prompts

    rows = rl_prompts([Trace.model_validate(trace("1", 0, 0.9))], {"1": {"question": "q?", "contexts": ["a"]}},
                      datasets.rl_agents(params), Drops())
    mine = [r for r in rows if r["role"] == "review_board"]
    assert [(r["agent"], r["schema"]) for r in mine] == [("peer_reviewer", "Review")]
    review = '{"severity": "MINOR", "issues": ["sample size unstated"], "summary": "sound design"}'
    graded = asyncio.run(completion.score(None, params.ppo.reward.model_copy(update={"judge": 0.0}), params.judge,  # type: ignore[arg-type]
                                          params.reward, "peer_reviewer", "Review", review, {"final_decision": "yes"}))
    assert graded["validity"] == 1.0 and graded["reason"].startswith("valid Review")

    raw["ppo"]["roles"]["review_board"]["agents"] = ["peer_reviewer", "principal_investigator"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=r"ppo\.roles\.review_board\.agents: \['principal_investigator'\] are not agents of "
                                        r"roles\.review_board"):
        load_params(tmp_path / "p.yaml", environ={})
    raw["ppo"]["roles"] = {"principal_investigator": {"out_dir": "models/ppo/pi", "agents": ["principal_investigator"]}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=r"ppo\.roles\.principal_investigator: roles\.principal_investigator decides"):
        load_params(tmp_path / "p.yaml", environ={})
