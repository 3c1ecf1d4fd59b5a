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


def test_train_sft_fails_on_missing_and_too_small_data(project: Path, capsys: pytest.CaptureFixture) -> None:
    args = argparse.Namespace(no_mlflow=True, in_model_plane=False, params_path=None)
    assert train_sft.main(args, load_params()) == 1
    assert "data/datasets/sft/train.jsonl: no SFT examples; run the datasets stage first" in capsys.readouterr().err
    _write(project / "data/datasets/sft/train.jsonl", [{"prompt": [], "completion": [], "rollout_id": "1-0"}])
    assert train_sft.main(args, load_params()) == 1
    assert "1 SFT example row(s); training needs at least 2" in capsys.readouterr().err
    assert not (project / "models/sft").exists()


def test_train_bandit_fails_on_too_few_decisions(project: Path, capsys: pytest.CaptureFixture) -> None:
    _write(project / "data/datasets/bandit/train.jsonl", [{"chosen": 0}])
    assert train_bandit.main(argparse.Namespace(no_mlflow=True), load_params()) == 1
    assert "1 logged decision row(s); the bandit needs at least 2" in capsys.readouterr().err
    assert not (project / "models/bandit").exists()


def test_sft_eval_slice_holds_out_whole_rollouts() -> None:
    cfg = load_params(Path(__file__).resolve().parent.parent / "params.yaml").sft
    rows = [{"rollout_id": f"{r}-0", "i": i} for r in range(5) for i in range(4)]
    train, evals = train_sft.split(rows, cfg)
    assert len(train) + len(evals) == len(rows) and evals
    assert not {r["rollout_id"] for r in train} & {r["rollout_id"] for r in evals}
    single = [{"rollout_id": "1-0", "i": i} for i in range(5)]
    train, evals = train_sft.split(single, cfg)
    assert len(evals) == 1 and len(train) == 4
