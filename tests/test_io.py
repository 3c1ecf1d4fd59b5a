from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.io import atomic_dir, atomic_open


def test_atomic_open_keeps_old_file_on_error(tmp_path: Path) -> None:
    dest = tmp_path / "out.txt"
    dest.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(dest) as fh:
            fh.write("half")
            raise RuntimeError("boom")
    assert dest.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_dir_swaps_whole_or_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "splits"
    dest.mkdir()
    (dest / "a").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("v2")
            raise RuntimeError("boom")
    assert (dest / "a").read_text() == "v1"
    with atomic_dir(dest) as tmp:
        (tmp / "b").write_text("v2")
    assert sorted(p.name for p in dest.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splits"]
