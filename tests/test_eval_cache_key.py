"""A cached champion evaluation is reused only when everything that scored it is the same (#27: prompts, judge,
schemas, served weights, worker settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_params
from pipeline.stages import evaluate
from tests.conftest import ROOT


def test_the_scoring_code_hash_moves_with_a_prompt_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for rel in evaluate.SCORING_CODE:
        target = tmp_path / rel
        if rel.endswith(".py"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("X = 1\n")
        else:
            target.mkdir(parents=True, exist_ok=True)
            (target / "mod.py").write_text("PROMPT = 'You design experimental protocols.'\n")
    monkeypatch.setattr(evaluate, "REPO_ROOT", tmp_path)
    before = evaluate.code_sha256()
    (tmp_path / "pipeline/agents/__pycache__").mkdir()
    (tmp_path / "pipeline/agents/__pycache__/mod.cpython-312.pyc").write_bytes(b"\x00")  # bytecode is not the code
    assert evaluate.code_sha256() == before
    (tmp_path / "pipeline/agents/mod.py").write_text("PROMPT = 'You design careful experimental protocols.'\n")
    assert evaluate.code_sha256() != before


def test_served_weights_and_worker_settings_are_part_of_the_key(tmp_path: Path) -> None:
    model = tmp_path / "base"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    env = {"PIPELINE__SERVING__WORKERS": f"[{{name: base, model: '{model}', port: 8100}}]"}
    params = load_params(ROOT / "params.yaml", environ=env)
    served = evaluate.served_models(params.serving)
    assert served["base"]["model_md5"] and served["base"]["max_model_len"] == 2048
    (model / "model.safetensors").write_bytes(b"other weights")
    assert evaluate.served_models(params.serving)["base"]["model_md5"] != served["base"]["model_md5"]
    longer = load_params(ROOT / "params.yaml", environ={"PIPELINE__SERVING__WORKERS": f"[{{name: base, model: '{model}', port: 8100, max_model_len: 4096}}]"})
    assert evaluate.served_models(longer.serving)["base"] != evaluate.served_models(params.serving)["base"]


def test_the_rendered_prompt_texts_are_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """#53: a champion evaluation cached while one PI prompt version was routed is not reused once another is (the key
    digests every text the society renders, routed or the repository's)."""
    from pipeline.agents.prompts import PI, REPOSITORY

    monkeypatch.setattr(evaluate, "dvc_md5", lambda path: "md5")  # the split and index files: not what this checks
    params = load_params(ROOT / "params.yaml", environ={})

    def key(prompts: object) -> str:
        return evaluate.cache_key(params, {}, {"principal_investigator": "base"}, {}, [{"id": "1"}], prompts)  # type: ignore[arg-type]

    routed = REPOSITORY.with_text(PI, REPOSITORY.text(PI) + " Weigh the conclusion first.", 3)
    assert key(REPOSITORY) == key(REPOSITORY) != key(routed)
    assert key(REPOSITORY.with_text(PI, REPOSITORY.text(PI), 3)) == key(REPOSITORY)  # the same text under a version number
