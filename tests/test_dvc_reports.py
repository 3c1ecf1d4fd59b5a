"""DVC-native reports: the cycle view as DVC's metrics, one concise headline file per stage, curves and bars as data
plots with templates.

`dvc metrics show/diff` and `dvc exp show` read ``reports/cycle/`` (a row per candidate and one for the society,
rebuilt from the stages' headline files); each stage writes ``reports/metrics/<stage>.json`` (headline keys picked by
``pipeline.metrics_files`` out of the stage's detailed report; both plain outputs; a training stage of one role,
``train_<kind>@<role>``, writes ``reports/metrics/train_<kind>/<role>.json`` beside ``reports/train_<kind>/<role>.json``);
`dvc plots show/diff` render the data files under ``reports/plots/`` through dvc.yaml's top-level ``plots:`` and the
training stages' own ``plots:`` (one curve per role). Checked against the committed ``reports/`` (the outputs of the last
`make run`) and DVC's resolution of dvc.yaml, without running any stage.
"""

from __future__ import annotations

import ast
import csv
import json
import subprocess
import sys
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


def _headline_files(stage: dict[str, Any]) -> list[str]:
    return [p for p in _paths(stage.get("outs", [])) if p.startswith(metrics_files.DIR.as_posix() + "/")]


def _with_metrics() -> list[str]:
    """Every resolved stage that writes a headline file (each training stage once per role)."""
    return sorted(n for n, st in dvc_stages().items() if _headline_files(st))


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


def test_every_headline_file_is_one_stage_selection_and_the_cycle_view_is_dvcs_metrics() -> None:
    dvc = _dvc()
    stages = dvc["stages"]
    assert dvc["metrics"] == [metrics_files.CYCLE_DIR.as_posix()], "dvc metrics show: the cycle view only"
    assert not [n for n, st in stages.items() if st.get("metrics")], "a stage's headlines are a plain out, not a metric"
    declared = {name: _headline_files(stage) for name, stage in stages.items()}
    # a kind's headlines serve each of its roles' stages
    assert set(metrics_files.HEADLINES) == {n.partition("@")[0] for n, files in declared.items() if files}, \
        "a stage without headlines, or headlines without a stage"
    for name, files in declared.items():
        assert files == [metrics_files.path(name).as_posix()], f"{name}: one headline file, got {files}"
        assert _cache(stages[name]["outs"], files[0]) is False
    produced = [metrics_files.path(s).as_posix() for s in metrics_files.HEADLINES]
    assert len(produced) == len(set(produced))


def test_each_stage_writes_its_headlines_beside_its_detailed_report() -> None:
    for name, stage in _dvc()["stages"].items():
        report, module, trained = _detailed_report(stage), _stage_module(stage), _kind(name)
        files = training.files(*trained) if trained else None
        written = files.report.as_posix() if files else _metrics_file_constant(module)
        assert written == report, f"{name}: {module.name} writes another report than dvc.yaml declares"
        assert not files or (files.stage == name and metrics_files.path(files.stage).as_posix() in _headline_files(stage))
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


def test_committed_cycle_view_is_rebuilt_from_the_committed_headline_files() -> None:
    files = sorted((ROOT / metrics_files.DIR).rglob("*.json"))
    rows = metrics_files.cycle_view({metrics_files.stage_of(f.relative_to(ROOT)): json.loads(f.read_text()) for f in files})
    committed = {f.stem: json.loads(f.read_text()) for f in (ROOT / metrics_files.CYCLE_DIR).glob("*.json")}
    assert committed == json.loads(json.dumps(rows))
    # every candidate the cycle promoted or refused has its row, with what learned it and the decision
    decisions = _committed("promote")["decisions"]
    for key, decision in decisions.items():
        assert committed[key]["decision"] == decision["status"] and committed[key]["trainer"] in {k.value for k in Learning}
    assert {"reward", "rollouts", "test.acc", "test.n"} <= set(committed[metrics_files.SOCIETY])


def test_dvc_metrics_show_fits_a_200_column_terminal() -> None:
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), "metrics", "show"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 + len(list((ROOT / metrics_files.CYCLE_DIR).glob("*.json"))), proc.stdout
    assert max(map(len, lines)) <= 200, proc.stdout
    assert lines[0].split()[:4] == ["Path", "ci_hi", "ci_lo", "decision"]


def test_cycle_view_rows_follow_the_stage_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer names its candidate's row, evaluate and promote fill the rows of the keys they hold, the society row
    takes the rest; a row no stage file names any more is gone at the next write (no stale decision stays shown)."""
    monkeypatch.chdir(tmp_path)
    metrics_files.write("train_prompt@principal_investigator", {"no_signal": True, "status": "no_signal"})
    metrics_files.write("train_bandit@supervisor", {"decisions": 4, "dr_gain": 0.01})
    metrics_files.write("evaluate", {"tasks": 30, "roles": {"supervisor_policy": {"diff": 0.1, "n": 30, "diff_p_value": 0.02}}})
    metrics_files.write("rollouts", {"total": {"rollouts": 8, "mean_reward": 0.4}})
    rows = {f.stem: json.loads(f.read_text()) for f in (tmp_path / metrics_files.CYCLE_DIR).glob("*.json")}
    assert rows == {"principal_investigator@prompt": {"signal": False, "trainer": "prompt"},
                    "supervisor_policy": {"diff": 0.1, "n": 30, "p": 0.02, "signal": True, "trainer": "bandit"},
                    "society": {"reward": 0.4, "rollouts": 8}}
    (tmp_path / metrics_files.path("train_prompt@principal_investigator")).unlink()
    metrics_files.write("promote", {"decisions": {"supervisor_policy": {"status": "promoted", "candidate": "3"}}})
    rows = {f.stem: json.loads(f.read_text()) for f in (tmp_path / metrics_files.CYCLE_DIR).glob("*.json")}
    assert set(rows) == {"supervisor_policy", "society"} and rows["supervisor_policy"]["decision"] == "promoted"


def test_dvc_metrics_diff_after_a_promotion_names_the_rows_that_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dvc = str(Path(sys.executable).parent / "dvc")
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([dvc, "init", "-q"], check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"metrics": [metrics_files.CYCLE_DIR.as_posix()]}))
    metrics_files.write("train_pi@principal_investigator", {"steps": 8, "no_signal": False})
    metrics_files.write("promote", {"decisions": {"principal_investigator": {"status": "rejected", "candidate": "2"}}})
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "cycle 1"], check=True)
    metrics_files.write("promote", {"decisions": {"principal_investigator": {"status": "promoted", "candidate": "3"}}})
    diff = subprocess.run([dvc, "metrics", "diff", "--json"], capture_output=True, text=True, check=True)
    moved = json.loads(diff.stdout)["reports/cycle/principal_investigator.json"]
    assert moved["decision"] == {"old": "rejected", "new": "promoted"} and moved["version"] == {"old": "2", "new": "3"}


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
