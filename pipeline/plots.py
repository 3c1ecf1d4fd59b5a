"""PNG figures for MLflow artifacts and `dvc plots`: headless, written atomically, always closed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.io import atomic_path


@contextlib.contextmanager
def png(dest: str | Path, size: tuple[float, float] = (6, 3.5)) -> Iterator[Any]:
    """Yield a matplotlib Axes; on success the figure is saved to ``dest`` (PNG) in one rename."""
    import matplotlib  # noqa: PLC0415 - 0.5 s import, only for a figure (and the backend must be set before pyplot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        with atomic_path(dest, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def message(dest: str | Path, text: str) -> None:
    """A figure that says why there is no curve (a stage whose data carried no signal still owes its plot)."""
    with png(dest) as ax:
        ax.text(0.5, 0.5, text[:120], ha="center", va="center", wrap=True)
        ax.set_axis_off()
