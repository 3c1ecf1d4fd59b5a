"""Read one validated split as task dicts (sorted by id, optionally capped), the form the society takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Params


def split_file(params: Params, split: str) -> Path:
    return Path(params.validate_.out_dir) / f"{split}.parquet"


def load_tasks(params: Params, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    import pandas as pd

    frame = pd.read_parquet(split_file(params, split)).sort_values("id")
    if limit:
        frame = frame.head(limit)
    return [{**r, "id": str(r["id"]), "contexts": list(r["contexts"]), "meshes": list(r["meshes"]), "labels": list(r["labels"])}
            for r in frame.to_dict("records")]
