"""Read one validated split as task dicts (sorted by id, optionally capped), the form the society takes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.config import ValidateParams


def split_file(validate: ValidateParams, split: str) -> Path:
    return Path(validate.out_dir) / f"{split}.parquet"


def read_split(validate: ValidateParams, split: str) -> pd.DataFrame:
    """One validated split as a table; a missing one raises FileNotFoundError naming the file and the stage that writes it."""
    if not (path := split_file(validate, split)).exists():
        raise FileNotFoundError(f"{path}: missing; run `python -m pipeline validate` first")
    return pd.read_parquet(path)


def load_tasks(validate: ValidateParams, split: str, limit: int | None = None,
               rotation: str | None = None, setting: str | None = None) -> list[dict[str, Any]]:
    """The split's tasks by id; with ``limit``, the first ``limit`` ids, or with ``rotation`` a sample of
    ``limit`` drawn with that string as seed (evaluation rotates its tasks across cycles, so a cycle's gate
    does not always look at the same few questions), returned sorted by id."""
    frame = read_split(validate, split).sort_values("id")
    if limit and rotation is not None and limit < len(frame):
        seed = int.from_bytes(hashlib.sha256(rotation.encode()).digest()[:4], "big")
        frame = frame.sample(n=limit, random_state=seed).sort_values("id")
    elif limit:
        frame = frame.head(limit)
    extra = {"setting": setting} if setting else {}
    return [{**r, "id": str(r["id"]), "contexts": list(r["contexts"]), "meshes": list(r["meshes"]), "labels": list(r["labels"]),
             **extra} for r in frame.to_dict("records")]
