"""DVC-native reports: one concise metrics file per stage, curves and bars as data plots with templates.

`dvc metrics show/diff` and `dvc exp show` read ``reports/metrics/<stage>.json`` (headline keys picked by
``pipeline.metrics_files`` out of the stage's detailed report, which is a plain output; a training stage of one role,
``train_<kind>@<role>``, writes ``reports/metrics/train_<kind>/<role>.json`` beside ``reports/train_<kind>/<role>.json``);
`dvc plots show/diff` render the data files under ``reports/plots/`` through dvc.yaml's top-level ``plots:`` and the
training stages' own ``plots:`` (one curve per role). Checked against the committed ``reports/`` (the outputs of the last
`make run`) and DVC's resolution of dvc.yaml, without running any stage.
"""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline import metrics_files, training
from pipeline.cli import COMMANDS
from pipeline.learning import Learning
from tests.conftest import ROOT, dvc_stages

DATA_SUFFIXES = {".csv", ".tsv", ".json"}
TEMPLATES = {"linear", "simple", "smooth", "scatter", "bar_horizontal", "bar_horizontal_sorted"}


def _dvc() -> dict[str, Any]:
    return {**yaml.safe_load((ROOT / "dvc.yaml").read_text()), "stages": dvc_stages()}


def _kind(name: str) -> tuple[Learning, str] | None:
    """(kind, role) of a training stage ``train_<kind>@<role>``; None for any other stage."""
    stage, _, role = name.partition("@")
    return (Learning(stage.removeprefix("train_")), role) if role else None


def _paths(entries: list[Any]) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries]


def _cache(entries: list[Any], path: str) -> Any:
    entry = next(e for e in entries if (next(iter(e)) if isinstance(e, dict) else e) == path)
    return entry[path].get("cache", True) if isinstance(entry, dict) and entry[path] else True


def _detailed_report(stage: dict[str, Any]) -> str:
    reports = [p for p in _paths(stage.get("outs", [])) if p.startswith("reports/") and p.endswith(".json")
               and not p.startswith(("reports/plots/", "reports/metrics/")) and p.count("/") <= 2]
    assert len(reports) == 1, f"one detailed report per stage among its outs, got {reports}"
    return reports[0]


def _stage_module(stage: dict[str, Any]) -> Path:
    module = COMMANDS[stage["cmd"].split()[3]][0]
    return ROOT / Path(*module.split(".")).with_suffix(".py")


def _metrics_file_constant(module: Path) -> str:
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "METRICS_FILE" for t in node.targets):
            call = node.value
            assert isinstance(call, ast.Call) and isinstance(call.args[0], ast.Constant)
            return str(call.args[0].value)
    raise AssertionError(f"{module}: no METRICS_FILE")


def _committed(stage: str) -> dict[str, Any]:
    return json.loads((ROOT / _detailed_report(_dvc()["stages"][stage])).read_text())


def _with_metrics() -> list[str]:
    """Every resolved stage that declares a metrics file (each training stage once per role)."""
    return sorted(n for n, st in dvc_stages().items() if st.get("metrics"))


def _fields(path: Path) -> set[str]:
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        rows = data if isinstance(data, list) else next(v for v in data.values() if isinstance(v, list))
        return set().union(*(r.keys() for r in rows))
    with path.open(newline="") as fh:
        return set(csv.DictReader(fh, delimiter="\t" if path.suffix == ".tsv" else ",").fieldnames or [])


def _plots() -> list[tuple[str, dict[str, Any]]]:
    """Top-level plots, then each stage's own (a training stage's curve of its role): (id or path, properties)."""
    top = [next(iter(e.items())) if isinstance(e, dict) else (e, {}) for e in _dvc().get("plots", [])]
    staged = [next(iter(e.items())) if isinstance(e, dict) else (e, {}) for st in _dvc()["stages"].values()
              for e in st.get("plots", [])]
    return top + staged


def test_every_metrics_file_is_one_stage_headline_selection() -> None:
    stages = _dvc()["stages"]
    declared = {name: _paths(stage.get("metrics", [])) for name, stage in stages.items()}
    # a kind's headlines serve each of its roles' stages
    assert set(metrics_files.HEADLINES) == {n.partition("@")[0] for n, files in declared.items() if files}, \
        "a stage without headlines, or headlines without a stage"
    for name, files in declared.items():
        assert files == [metrics_files.path(name).as_posix()], f"{name}: metrics must be its concise file only, got {files}"
        assert _cache(stages[name]["metrics"], files[0]) is False
    produced = [metrics_files.path(s).as_posix() for s in metrics_files.HEADLINES]
    assert len(produced) == len(set(produced))


def test_each_stage_writes_its_headlines_beside_its_detailed_report() -> None:
    for name, stage in _dvc()["stages"].items():
        report, module, trained = _detailed_report(stage), _stage_module(stage), _kind(name)
        files = training.files(*trained) if trained else None
        written = files.report.as_posix() if files else _metrics_file_constant(module)
        assert written == report, f"{name}: {module.name} writes another report than dvc.yaml declares"
        assert not files or (files.stage == name and metrics_files.path(files.stage).as_posix() in _paths(stage["metrics"]))
        assert _cache(stage["outs"], report) is False, f"{name}: {report} is a plain output (cache: false)"
        text = module.read_text()
        # a trainer's report and headlines are written by the shared trainer sequence (pipeline/training.py) it declares
        shared = (trained is not None and f"training.files(Learning.{trained[0].name}" in text and "training.Trainer(" in text
                  and "metrics_files.write(t.stage" in (ROOT / "pipeline/training.py").read_text())
        assert f'metrics_files.write("{name}"' in text or shared, f"{name}: {module.name} never writes its headline metrics"
        assert "pipeline/metrics_files.py" in stage["deps"], f"{name}: the headline selection changes its metrics file"


@pytest.mark.parametrize("stage", _with_metrics())
def test_headlines_are_few_and_exist_in_the_committed_report(stage: str) -> None:
    report = _committed(stage)
    headlines = metrics_files.HEADLINES[stage.partition("@")[0]]
    assert len(headlines) <= metrics_files.MAX_KEYS
    assert len(set(headlines)) == len(headlines)
    # a no-signal run has no training figures and a cycle without a challenger no per-role ones: only a headline the
    # report could never hold is a mistake
    missing = [h for h in headlines if not metrics_files.lookup(report, h) and not report.get("no_signal") and "*" not in h]
    assert not missing, f"{stage}: not in {_detailed_report(_dvc()['stages'][stage])}: {missing}"
    selected = metrics_files.select(stage, report)
    assert 0 < len(selected) <= metrics_files.MAX_KEYS, f"{stage}: {len(selected)} keys: `dvc metrics show` would not fit"
    assert all(isinstance(v, (int, float, str)) for v in selected.values())


@pytest.mark.parametrize("stage", _with_metrics())
def test_committed_metrics_files_are_the_selection_of_the_committed_reports(stage: str) -> None:
    committed = json.loads((ROOT / metrics_files.path(stage)).read_text())
    assert committed == json.loads(json.dumps(metrics_files.select(stage, _committed(stage))))


def test_select_reads_dotted_keys_wildcards_and_skips_what_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(metrics_files.HEADLINES, "demo", ("sft.rows", "total.reward", "roles.*.diff", "gone.key", "empty"))
    report = {"sft.rows": 3, "total": {"reward": 0.5, "n": 2}, "roles": {"a": {"diff": 0.1}, "b": {"diff": -0.2, "n": 1}}, "empty": None}
    assert metrics_files.select("demo", report) == {"sft.rows": 3, "total.reward": 0.5, "roles.a.diff": 0.1, "roles.b.diff": -0.2}
    assert metrics_files.select("demo", {"no_signal": True}) == {}
    monkeypatch.setitem(metrics_files.HEADLINES, "demo", ("total",))
    with pytest.raises(ValueError, match="not a number"):
        metrics_files.select("demo", report)


def test_write_puts_the_selection_under_reports_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert metrics_files.write("ingest", {"rows": 5, "train": {"rows": 4}, "extra": 1}) == {"rows": 5, "train.rows": 4}
    assert json.loads((tmp_path / "reports/metrics/ingest.json").read_text()) == {"rows": 5, "train.rows": 4}


def test_plots_are_data_files_whose_fields_exist() -> None:
    plots = _plots()
    assert plots, "dvc.yaml declares no plots"
    stages = _dvc()["stages"]
    outs = {p: (name, {"outs": stage.get("outs", []) + stage.get("plots", [])}) for name, stage in stages.items()
            for p in _paths(stage.get("outs", []) + stage.get("plots", []))}
    for plot_id, props in plots:
        assert props.get("template") in TEMPLATES, f"{plot_id}: template {props.get('template')!r}"
        ys = props["y"] if isinstance(props.get("y"), dict) else {plot_id: props.get("y")}
        for path, y in ys.items():
            file = ROOT / path
            assert file.suffix in DATA_SUFFIXES, f"{plot_id}: {path} is not a data file"
            assert path in outs and _cache(outs[path][1]["outs"], path) is False, f"{plot_id}: {path} is no stage's plain output"
            fields = _fields(file)
            x = props["x"][path] if isinstance(props.get("x"), dict) else props.get("x")
            for field in [x, *(y if isinstance(y, list) else [y])]:
                assert field in fields, f"{plot_id}: {path} has no field {field!r} (has {sorted(fields)})"


def test_no_png_in_dvc_plots_and_pngs_stay_plain_outs() -> None:
    stages = _dvc()["stages"]
    # stage-level plots only where one stage per role needs its own curve (a foreach stage): top-level plots cannot
    assert not [n for n, s in stages.items() if s.get("plots") and not _kind(n)], "stage-level plots outside a trainer"
    declared = [p for plot_id, props in _plots() for p in (props["y"] if isinstance(props.get("y"), dict) else [plot_id])]
    assert not [p for p in declared if p.endswith(".png")]
    outs = {p for s in stages.values() for p in _paths(s.get("outs", []))}
    for png in sorted((ROOT / "reports/plots").rglob("*.png")):
        assert png.relative_to(ROOT).as_posix() in outs, f"{png.name}: an MLflow artifact that is no stage's output"
