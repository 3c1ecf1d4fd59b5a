"""Benchmark reports: a table the script regenerates, above a hand-written ``## Notes`` section
that survives reruns (how to read the figures stays next to them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.io import write_json, write_text

NOTES = "## Notes"


def p_text(p: float) -> str:
    """An exact p-value as a report writes it: ``= 4.10e-45``; 0.0 only below a double's range."""
    return f"= {p:.2e}" if p > 0 else "< 1e-300 (below a double's range)"


def write_report(out: str | Path, lines: list[str]) -> None:
    out = Path(out)
    notes = out.read_text().partition(NOTES)[2] if out.exists() else ""
    write_text(out, "\n".join(lines) + (f"\n{NOTES}{notes}" if notes else ""))


def publish(out: str | Path, lines: list[str], doc: Any) -> None:
    """Print the table, write it as markdown (notes kept) and its figures as JSON beside it."""
    print("\n".join(lines))
    write_report(out, lines)
    write_json(Path(out).with_suffix(".json"), doc)
