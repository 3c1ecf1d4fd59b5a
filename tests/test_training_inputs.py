"""Training stages refuse unusable input up front, naming the file and the reason (fast, no torch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipeline.config import load_params
from pipeline.stages import train_bandit, train_sft


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_train_sft_fails_on_missing_data_and_reports_no_signal_without_rows(project: Path, capsys: pytest.CaptureFixture) -> None:
    args = argparse.Namespace(no_mlflow=True, in_model_plane=False, params_path=None, role="junior_researcher")
    assert train_sft.main(args, load_params()) == 1
    assert "data/datasets/sft/junior_researcher/train.jsonl: no SFT examples; run the datasets stage first" in capsys.readouterr().err
    _write(project / "data/datasets/sft/junior_researcher/train.jsonl", [{"prompt": [], "completion": [], "task_id": "1", "rollout_id": "1-0"}])
    assert train_sft.main(args, load_params()) == 0  # the cycle goes on: this role simply has no candidate
    assert "no_signal, nothing trained or registered" in capsys.readouterr().out
    report = json.loads((project / "reports/train_sft/junior_researcher.json").read_text())
    assert report["no_signal"] and "1 SFT example(s)" in report["no_signal_reason"]
    assert not (project / "models/sft/junior_researcher/adapter").exists()


def _decision(reward: float, actions: int = 3) -> dict:
    return {"context": "q", "actions": [f"a{i}" for i in range(actions)], "chosen": 0, "propensity": 0.9,
            "logging_pmf": [0.9] + [0.1 / max(1, actions - 1)] * (actions - 1), "reward": reward}


def test_train_bandit_fails_on_too_few_decisions_and_reports_no_signal(project: Path, capsys: pytest.CaptureFixture) -> None:
    _write(project / "data/datasets/bandit/train.jsonl", [{"chosen": 0}])
    assert train_bandit.main(argparse.Namespace(no_mlflow=True, role="supervisor"), load_params()) == 1
    assert ("train.jsonl:1: each logged decision row needs context, actions, chosen, propensity, reward, logging_pmf "
            "(missing: context, actions, propensity, reward, logging_pmf)") in capsys.readouterr().err
    _write(project / "data/datasets/bandit/train.jsonl", [_decision(0.4)])
    assert train_bandit.main(argparse.Namespace(no_mlflow=True, role="supervisor"), load_params()) == 1
    assert "1 logged decision row(s); the bandit needs at least 2" in capsys.readouterr().err
    assert not (project / "models/bandit").exists()
    assert "offered one action" in train_bandit.no_signal_reason([_decision(0.3, 1), _decision(0.7, 1)])
    assert train_bandit.no_signal_reason([_decision(0.3), _decision(0.7)]) is None
    _write(project / "data/datasets/bandit/train.jsonl", [_decision(0.4) for _ in range(4)])
    assert train_bandit.main(argparse.Namespace(no_mlflow=True, role="supervisor"), load_params()) == 0
    assert "all 4 logged rewards are equal" in capsys.readouterr().out
    assert json.loads((project / "reports/train_bandit/supervisor.json").read_text())["no_signal"]
    assert not (project / "models/bandit/policy.vw").exists()


def test_trainers_without_signal_register_nothing(project: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant rewards: the GRPO check says no_signal and the stage's MLflow run registers no version (SFT and bandit alike)."""
    import mlflow

    from pipeline.rl import grpo_cpu
    from pipeline.stages import train_ppo

    scored = [{"value": 0.2, "validity": 1.0, "group": f"0-{i // 2}"} for i in range(8)]
    sig = grpo_cpu.signal(scored)
    assert sig["no_signal"] and sig["zero_advantage_groups"] == sig["groups"] == 4 and sig["reward_std"] == 0.0
    assert sig["valid_fraction"] == 1.0
    varied = grpo_cpu.signal([{**r, "value": 0.2 + 0.1 * (i % 2)} for i, r in enumerate(scored)])
    assert not varied["no_signal"] and varied["zero_advantage_groups"] == 0 and varied["reward_std"] > 0

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    params = load_params()
    out = project / params.ppo.at("senior_researcher").out_dir
    out.mkdir(parents=True)
    (out / "log_history.json").write_text("[]")
    metrics = {"backend": "trl", "algorithm": "grpo", **sig}
    mlflow.set_tracking_uri(mlflow_server)
    client = mlflow.MlflowClient(mlflow_server)
    count = lambda name: len(client.search_model_versions(f"name = '{name}'"))  # noqa: E731 - the server is shared by the session
    before = {name: count(name) for name in ("senior_researcher", "junior_researcher")}
    with mlflow.start_run(run_name="no-signal-ppo") as run:
        assert train_ppo.log_and_register(params, "senior_researcher", metrics, run) is None
    assert mlflow.get_run(run.info.run_id).data.tags["no_signal"] == "true"
    _write(project / "data/datasets/sft/junior_researcher/train.jsonl", [])
    args = argparse.Namespace(no_mlflow=False, in_model_plane=False, params_path=None, role="junior_researcher")
    assert train_sft.main(args, params) == 0
    assert {name: count(name) for name in before} == before


def test_sft_eval_slice_holds_out_whole_tasks() -> None:
    cfg = load_params(Path(__file__).resolve().parent.parent / "params.yaml").sft
    rows = [{"task_id": str(t), "rollout_id": f"{t}-{r}", "i": i} for t in range(5) for r in range(2) for i in range(2)]
    train, evals = train_sft.split(rows, cfg)
    assert len(train) + len(evals) == len(rows) and evals
    # at datasets.sft.top_k 2 a task keeps two rollouts: neither is trained on while the other is held out
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in evals}
    single = [{"task_id": "1", "rollout_id": "1-0", "i": i} for i in range(5)]
    train, evals = train_sft.split(single, cfg)
    assert len(evals) == 1 and len(train) == 4
    # a row repeated to weigh it in training (train_pi's pi.oversample) is held out with its copies, and counted once
    weighted = [{"task_id": str(q), "rollout_id": str(q), "label": "maybe" if q % 2 else "yes"}
                for q in range(40) for _ in range(1 + 2 * (q % 2))]
    train, evals = train_sft.split(weighted, cfg.model_copy(update={"eval_fraction": 0.25}))
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in evals}
    assert len(evals) == len({r["task_id"] for r in evals}) > 1 and {r["label"] for r in evals} == {"yes", "maybe"}


@pytest.mark.parametrize(("line", "rule"), [
    ("not json", "each SFT example row must be one JSON object (Expecting value)"),
    ("[1, 2]", "each SFT example row must be one JSON object (found a list)"),
    ('{"prompt": [], "rollout_id": "1-0"}', "each SFT example row needs task_id, prompt, completion (missing: task_id, completion)"),
    (b'{"prompt": "\xff"}', "byte 82: not UTF-8 (invalid start byte)"),
])
def test_a_bad_training_row_fails_in_one_line_naming_file_line_and_rule(project: Path, capsys: pytest.CaptureFixture,
                                                                        line: str, rule: str) -> None:
    path = project / "data/datasets/sft/junior_researcher/train.jsonl"
    _write(path, [{"prompt": [], "completion": [], "task_id": "1", "rollout_id": "1-0"}])
    path.write_bytes(path.read_bytes() + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    args = argparse.Namespace(no_mlflow=True, in_model_plane=False, params_path=None, role="junior_researcher")
    assert train_sft.main(args, load_params()) == 1
    err = capsys.readouterr().err
    where = "" if isinstance(line, bytes) else ":2"  # undecodable: the byte, in the whole file
    assert err == f"error: data/datasets/sft/junior_researcher/train.jsonl{where}: {rule}\n"
    assert not (project / "reports/train_sft/junior_researcher.json").exists()


def test_a_trainer_report_that_registers_nothing_must_say_why(tmp_path: Path) -> None:
    """Every trainer's report is a `TrainerReport` (training.main reads it so before registering): `no_signal` without its
    reason is refused in one line; a kind's own figures travel beside the signal."""
    from pipeline.contracts import ContractError, TrainerReport, read

    path = tmp_path / "principal_investigator.json"
    path.write_text('{"no_signal": true, "steps": 3}')
    with pytest.raises(ContractError) as refused:
        read(TrainerReport, path)
    assert str(refused.value) == (f"{path}: the file: Value error, no_signal without its no_signal_reason: a trainer says why "
                                  "it registers nothing (not a TrainerReport; 1 error(s))")
    path.write_text('{"no_signal": false, "steps": 3}')
    assert read(TrainerReport, path).model_extra == {"steps": 3}
