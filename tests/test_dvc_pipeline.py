"""dvc.yaml rules that keep the test split honest: only `report` may depend on it."""

from __future__ import annotations

import yaml

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
