"""dvc.yaml rules that keep the test split honest: only `report` may depend on it."""

from __future__ import annotations

import yaml

from pipeline.learning import Learning, learners
from tests.conftest import ROOT, dvc_stages

DATA_STAGES = {"ingest", "validate"}  # they produce and check every split, test included


def _resolved_stages() -> dict[str, dict]:
    return dvc_stages()


def _test_split_paths() -> set[str]:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    validated, tasks = params["validate"]["out_dir"], params["data"]["out_dir"]
    return {validated, f"{validated}/test.parquet", tasks, f"{tasks}/test.parquet", params["data"]["test_ids"]}


def test_only_report_depends_on_the_test_split() -> None:
    stages = _resolved_stages()
    test_paths = {p.rstrip("/") for p in _test_split_paths()}
    offenders = {name: [d for d in stage.get("deps", []) if str(d).rstrip("/") in test_paths]
                 for name, stage in stages.items() if name not in DATA_STAGES | {"report"}}
    assert not {k: v for k, v in offenders.items() if v}, offenders
    report_deps = [str(d) for d in stages["report"]["deps"]]
    assert any(d.endswith("test.parquet") for d in report_deps)
    assert {"evaluate", "promote"} <= set(stages)
    assert any(str(d).endswith("val.parquet") for d in stages["evaluate"]["deps"])


def test_every_trainer_has_an_output_outside_git_so_a_fresh_clone_trains_and_registers_again() -> None:
    """A stage whose outputs are all committed to git (``cache: false``) is "unchanged" in a fresh clone whose dvc.lock
    matches its code: DVC skips it, and a fresh MLflow server never gets its version (train_prompt did, until its
    prompt text became ``models/prompt/<role>``)."""
    expected = {f"{kind.stage}@{role}" for kind, roles in learners(yaml.safe_load((ROOT / "params.yaml").read_text())).items()
                for role in roles}
    trainers = {name: stage for name, stage in _resolved_stages().items() if name in expected}
    assert set(trainers) == expected and {name.split("@")[0] for name in trainers} == {kind.stage for kind in Learning}
    in_git_only = [name for name, stage in trainers.items()
                   if all(isinstance(o, dict) and next(iter(o.values())).get("cache") is False for o in stage["outs"])]
    assert not in_git_only, in_git_only
