"""An honest lock under Airflow (#27): a DAG run's effective params (its params file + its UI Params) are one file that
every task reads, that MLflow keeps, and that dvc.lock records, instead of params.yaml's values."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import runs
from pipeline.config import load_params
from tests.conftest import ROOT


def test_the_effective_file_is_the_params_file_plus_the_runs_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "params", tmp_path / "params")
    monkeypatch.setenv("PIPELINE__PROMOTE__MARGIN", "0.1")  # a DAG run's `margin` Param
    path = runs.write_effective("params/gpu.yaml", "run-1")
    assert path == Path(".runs/run-1/params.yaml")
    raw = yaml.safe_load(path.read_text())
    assert "extends" not in raw and raw["promote"]["margin"] == 0.1 and raw["ppo"]["backend"] == "verl"  # the profile, resolved
    monkeypatch.delenv("PIPELINE__PROMOTE__MARGIN")
    params = load_params(path)  # a later task, without the run's environment, reads the same values
    assert params.promote.margin == 0.1 and params.validate_.labels == ["yes", "no", "maybe"]
    untouched = runs.write_effective(None, "run-2")  # no overrides: the file's own values, nothing else
    assert yaml.safe_load(untouched.read_text()) == yaml.safe_load((ROOT / "params.yaml").read_text())


def test_dvc_lock_records_the_values_that_produced_the_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    (tmp_path / "params.yaml").write_text("promote:\n  margin: 0.0\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  promote:\n    cmd: echo\n    params: [promote]\n    outs: [decision.txt]\n")
    (tmp_path / "decision.txt").write_text("promoted with margin 0.1\n")
    effective = tmp_path / ".runs/r/params.yaml"
    effective.parent.mkdir(parents=True)
    effective.write_text("promote:\n  margin: 0.1\n")
    monkeypatch.chdir(tmp_path)
    runs.commit_lock(effective, ["promote"])
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    assert lock["stages"]["promote"]["params"]["params.yaml"]["promote"] == {"margin": 0.1}
    assert (tmp_path / "params.yaml").read_text() == "promote:\n  margin: 0.0\n"  # the file is back as it was
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "promote"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "modified:" in status.stdout and "promote" in status.stdout  # honest: the output was produced with other values than the file holds


def test_dvc_lock_records_the_routing_the_rollouts_ran_with_not_the_one_promote_wrote(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Airflow the lock is committed at the end of the run, after `promote` rewrote the live routing file: the
    rollouts' entry must name the routing they were served by (open's snapshot), so the next run rolls out again."""
    import hashlib

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.yaml").write_text("stages:\n  rollouts:\n    cmd: echo\n    params: [rollouts]\n    deps: [live-routing.json]\n"
                                       "    outs: [traces.jsonl]\n")
    before, after = '{"version": 1}\n', '{"version": 2}\n'
    (tmp_path / "live-routing.json").write_text(before)
    effective = runs.write_effective(None, "r", "live-routing.json")  # the DAG's open_run
    (tmp_path / "traces.jsonl").write_text("{}\n")  # rollouts ran, served by routing v1
    (tmp_path / "live-routing.json").write_text(after)  # promote switched the routing
    runs.commit_lock(effective, ["rollouts"], "live-routing.json")
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    dep = next(d for d in lock["stages"]["rollouts"]["deps"] if d["path"] == "live-routing.json")
    assert dep["md5"] == hashlib.md5(before.encode()).hexdigest()
    assert (tmp_path / "live-routing.json").read_text() == after  # the live file is back as promote left it
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "rollouts"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "live-routing.json" in status.stdout  # the next run rolls out with the new champions


def test_a_profile_cycle_through_dvc_is_recorded_and_run_again_reproduces_nothing(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """#55: `make learn` is `run repro` of the pipeline's own stages with the profile's values standing in for
    params.yaml. dvc.lock records those values; the stages that read the live routing its promote moved are recorded
    with it (the cycle's own decision); the same cycle again reproduces nothing; params.yaml is back as it was, also
    after a process that was killed while its stand-in was in place."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("# the default profile\npi:\n  steps: 4\n")
    (tmp_path / "live-routing.json").write_text('{"version": 1}\n')
    # train: reads its value (counts its runs); evaluate: reads the live routing; promote: moves it (not an out)
    py = f"{sys.executable} -c"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "train": {"cmd": f"{py} \"import yaml,pathlib; p=pathlib.Path('runs.txt'); p.write_text(p.read_text()+'x' if "
                         f"p.exists() else 'x'); pathlib.Path('model.txt').write_text(str(yaml.safe_load(open('params.yaml'))"
                         f"['pi']['steps']))\"", "params": ["pi"], "outs": [{"model.txt": {"cache": False}}]},
        "evaluate": {"cmd": f"{py} \"import shutil; shutil.copy('model.txt', 'summary.txt')\"",
                     "deps": ["model.txt", "live-routing.json"], "outs": [{"summary.txt": {"cache": False}}]},
        "promote": {"cmd": f"{py} \"import pathlib; pathlib.Path('live-routing.json').write_text('{{\\\"version\\\": 2}}\\\\n'); "
                           f"pathlib.Path('decision.txt').write_text('promoted')\"",
                    "deps": ["summary.txt"], "outs": [{"decision.txt": {"cache": False}}]}}}))
    effective = tmp_path / ".runs/learn/params.yaml"
    effective.parent.mkdir(parents=True)
    effective.write_text("pi:\n  steps: 225\n")  # the profile, resolved (run open --write-params)
    stages = ["train", "evaluate", "promote"]
    assert runs.repro(effective, stages, True, "live-routing.json") == 0
    assert (tmp_path / "model.txt").read_text() == "225" and (tmp_path / "live-routing.json").read_text() == '{"version": 2}\n'
    assert (tmp_path / "params.yaml").read_text() == "# the default profile\npi:\n  steps: 4\n"
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["pi"] == {"steps": 225}
    with runs.run_inputs(effective):  # the cycle's status, with its values: clean
        status = subprocess.run([sys.executable, "-m", "dvc", "status", *stages], capture_output=True, text=True, env=env)
    assert "up to date" in status.stdout, status.stdout
    assert runs.repro(effective, stages, True, "live-routing.json") == 0
    assert (tmp_path / "runs.txt").read_text() == "x"  # the second cycle trained nothing
    # a process killed while its stand-in was in place: the next one puts params.yaml back first
    kept = (tmp_path / "params.yaml").read_text()
    runs.SAVED.mkdir(parents=True, exist_ok=True)
    (runs.SAVED / "params.yaml").write_text(kept)
    (tmp_path / "params.yaml").write_text(effective.read_text())
    assert runs.restore_stood_in() == ["params.yaml"] and (tmp_path / "params.yaml").read_text() == kept
    assert not list(runs.SAVED.iterdir())


def test_repro_without_an_open_run_is_one_line_naming_the_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`run repro` before `run open --write-params` (a hand-typed cycle step): the run's effective params are missing,
    so the user gets the file and the command that writes it, not a traceback, and params.yaml is not touched; an action
    that names no run is refused too. Either before any service starts."""
    from pipeline import cli, tracking  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(tracking.RUN_ID_ENV, "never-opened")  # what `run open` prints for the shell to export
    (tmp_path / "params.yaml").write_text("pi: {}\n")
    at = ["--params", str(ROOT / "params.yaml")]
    for action in ("repro", "status"):
        assert cli.main([*at, "run", action, "--stages", "train"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith("error: .runs/never-opened/params.yaml: no run never-opened is open")
        assert "run open --write-params" in err[0]
    assert not (tmp_path / ".mlflow").exists()  # refused before any service started
    monkeypatch.delenv(tracking.RUN_ID_ENV)
    for action in ("close", "times", "repro"):  # no run named: it would open and close a new one
        assert cli.main([*at, "run", action]) == 1
        assert capsys.readouterr().err == f"error: `run {action}`: which run? --run-id or $PIPELINE_RUN_ID (what `run open` printed)\n"
    assert cli.main([*at, "run", "fail", "--run-id", "x"]) == 1 and capsys.readouterr().err == "error: `run fail` needs --task\n"
    assert not (tmp_path / ".mlflow").exists()
    assert (tmp_path / "params.yaml").read_text() == "pi: {}\n" and not (tmp_path / ".runs/stood-in").exists()
