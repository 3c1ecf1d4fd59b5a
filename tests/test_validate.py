from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_params
from pipeline.stages import ingest, validate
from tests.conftest import ROOT, TEST_IDS, set_param


def _corrupt_source(tmp_path: Path, pubmedqa: dict) -> tuple[Path, dict[str, str]]:
    test_ids = set(json.loads(TEST_IDS.read_text()))
    train_ids = [k for k in pubmedqa if k not in test_ids]
    bad = {"perhaps": train_ids[0], "empty": train_ids[1], "dup": train_ids[2]}
    data = json.loads(json.dumps(pubmedqa))
    data[bad["perhaps"]]["final_decision"] = "perhaps"
    data[bad["empty"]]["QUESTION"] = ""
    body = json.dumps(data)[:-1] + f', "{bad["dup"]}": {json.dumps(data[bad["dup"]])}}}'
    path = tmp_path / "corrupt.json"
    path.write_text(body)
    return path, bad


def _cli(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **extra}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, env=env)


def test_clean_data_passes(project: Path) -> None:
    ingest.run(load_params())
    summary = validate.run(load_params())
    assert summary["success"] and summary["failed_expectations"] == 0
    assert summary["train_expectations"] >= 10
    assert len(pd.read_parquet(project / "data/validated/val.parquet")) == 100
    assert (project / "reports/validation/data_docs/index.html").exists()
    assert json.loads((project / "reports/validation/gx_results.json").read_text())["train"]["success"] is True


def test_corrupt_input_fails_naming_each_problem(project: Path, pubmedqa: dict) -> None:
    source, bad = _corrupt_source(project, pubmedqa)
    set_param(project, "data.source", str(source))
    # ingest refuses the bad label and the empty question, both in one run, before it replaces anything (the duplicate,
    # with the same label, is validate's unique-id rule); validate sees what quarantine would let through
    refused = _cli("ingest", "--no-mlflow")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and "2 problem(s)" in lines[0] and len(lines) == 3, refused.stderr
    assert "'perhaps'" in refused.stderr and f"(id {bad['empty']}): question: empty" in refused.stderr
    assert _cli("ingest", "--no-mlflow", PIPELINE__VALIDATE__QUARANTINE="true").returncode == 0
    # a previous good validated output must survive the failed run untouched
    (project / "data/validated").mkdir(parents=True)
    (project / "data/validated/train.parquet").write_bytes(b"previous")
    proc = _cli("validate", "--no-mlflow")
    assert proc.returncode == 1
    out = " ".join(proc.stderr.split())
    assert "expect_column_values_to_be_in_set on column 'final_decision'" in out and bad["perhaps"] in out and "'perhaps'" in out
    assert "expect_column_value_lengths_to_be_between on column 'question'" in out and bad["empty"] in out
    assert "expect_column_values_to_be_unique on column 'id'" in out and bad["dup"] in out
    assert "[train]" in out
    assert (project / "data/validated/train.parquet").read_bytes() == b"previous"
    failures = json.loads((project / "reports/validation/failures.json").read_text())["final"]
    assert {f["expectation"] for f in failures} == {"expect_column_values_to_be_in_set", "expect_column_value_lengths_to_be_between",
                                                    "expect_column_values_to_be_unique"}


def test_quarantine_moves_bad_rows_with_reasons(project: Path, pubmedqa: dict) -> None:
    source, bad = _corrupt_source(project, pubmedqa)
    set_param(project, "data.source", str(source))
    set_param(project, "validate.quarantine", True)
    ingest.run(load_params())
    summary = validate.run(load_params())
    assert summary["success"] and summary["quarantined_rows"] == 4  # both copies of the duplicate
    quarantine = pd.read_parquet(project / "data/validated/quarantine.parquet")
    reasons = {row["id"]: " ".join(row["reasons"]) for _, row in quarantine.iterrows()}
    assert "final_decision" in reasons[bad["perhaps"]] and "question" in reasons[bad["empty"]] and "unique id" in reasons[bad["dup"]]
    train = pd.read_parquet(project / "data/validated/train.parquet")
    assert not set(bad.values()) & set(train["id"])
    assert len(train) + 4 == 401


def test_table_level_rules_still_fail_with_quarantine(project: Path) -> None:
    set_param(project, "validate.quarantine", True)
    set_param(project, "validate.split_rows.val", {"min": 150, "max": 200})
    ingest.run(load_params())
    with pytest.raises(validate.ValidationFailed, match=r"\[val\] expect_table_row_count_to_be_between .*observed 100"):
        validate.run(load_params())


def test_leak_between_splits_is_reported(project: Path) -> None:
    ingest.run(load_params())
    train = pd.read_parquet(project / "data/tasks/train.parquet")
    val = pd.read_parquet(project / "data/tasks/val.parquet")
    leaked = pd.concat([val, train.iloc[:1]])
    leaked.to_parquet(project / "data/tasks/val.parquet", index=False)
    with pytest.raises(validate.ValidationFailed) as exc:
        validate.run(load_params())
    assert any("id not in another split" in m and train.iloc[0]["id"] in m for m in exc.value.messages)
