"""The great-expectations suite for the task table, and a plain reading of its results.

One suite per split: row-level rules (ids, nulls, labels, lengths, cross-split leakage) report the
offending ids, table-level rules (split size, label proportions) report observed values. The
results are reduced to ``Failure`` records so the CLI, the quarantine and MLflow share one view.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.config import ValidateParams

REQUIRED = ["id", "question", "contexts", "long_answer", "final_decision"]
ROW_LEVEL = {
    "expect_column_values_to_not_be_null",
    "expect_column_values_to_be_unique",
    "expect_column_values_to_be_in_set",
    "expect_column_value_lengths_to_be_between",
    "expect_column_values_to_be_between",
    "expect_column_values_to_not_be_in_set",
}


@dataclass
class Failure:
    split: str
    expectation: str
    column: str | None
    rule: str
    ids: list[str] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    observed: Any = None

    @property
    def row_level(self) -> bool:
        return self.expectation in ROW_LEVEL

    def describe(self) -> str:
        where = f"column '{self.column}'" if self.column else "table"
        text = f"[{self.split}] {self.expectation} on {where} ({self.rule})"
        if self.ids:
            shown = ", ".join(f"{i} ({v!r})" if v is not None else str(i)
                              for i, v in zip(self.ids[:10], self.values[:10], strict=False))
            more = f" and {len(self.ids) - 10} more" if len(self.ids) > 10 else ""
            text += f": {len(self.ids)} row(s): ids {shown}{more}"
        elif self.observed is not None:
            text += f": observed {self.observed}"
        return text


def prepare(frame: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """Derived columns the expectations need (lengths of list columns, label indicators)."""
    out = frame.copy()
    out["context_chars"] = out["contexts"].map(lambda c: None if c is None else int(sum(len(x) for x in c)))
    for label in labels:
        out[f"is_{label}"] = (out["final_decision"] == label).astype(float)
    return out


def build_suite(split: str, frames: Mapping[str, pd.DataFrame], validate: ValidateParams) -> Any:
    import great_expectations as gx  # noqa: PLC0415 - 2.6 s import, only running the suites needs it (not reading failures)
    import great_expectations.expectations as gxe  # noqa: PLC0415 - as above

    pool = pd.concat([frames[s] for s in ("train", "val") if s in frames])
    other_ids = sorted({i for s, f in frames.items() if s != split for i in f["id"].dropna()})
    suite = gx.ExpectationSuite(name=f"pubmedqa_tasks_{split}")
    for col in REQUIRED:
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=col, meta={"rule": "required column non-null"}))
    suite.add_expectation(gxe.ExpectColumnValuesToBeUnique(column="id", meta={"rule": "unique id"}))
    suite.add_expectation(gxe.ExpectColumnValuesToBeInSet(column="final_decision", value_set=validate.labels,
                                                          meta={"rule": f"label in {validate.labels}"}))
    suite.add_expectation(gxe.ExpectColumnValueLengthsToBeBetween(
        column="question", min_value=validate.question_chars.min, max_value=validate.question_chars.max,
        meta={"rule": f"question length in [{validate.question_chars.min}, {validate.question_chars.max}] chars"}))
    suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(
        column="context_chars", min_value=validate.context_chars.min, max_value=validate.context_chars.max,
        meta={"rule": f"context length in [{validate.context_chars.min}, {validate.context_chars.max}] chars"}))
    suite.add_expectation(gxe.ExpectColumnValuesToNotBeInSet(column="id", value_set=other_ids,
                                                             meta={"rule": "id not in another split"}))
    rows = validate.split_rows.get(split)  # type: ignore[call-overload]
    if rows is not None:
        suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=rows.min, max_value=rows.max,
                                                                 meta={"rule": f"{split} rows in [{rows.min}, {rows.max}]"}))
    if split in ("train", "val") and len(pool):
        for label in validate.labels:
            share = float((pool["final_decision"] == label).mean())
            lo, hi = max(0.0, share - validate.label_tolerance), min(1.0, share + validate.label_tolerance)
            suite.add_expectation(gxe.ExpectColumnMeanToBeBetween(
                column=f"is_{label}", min_value=round(lo, 4), max_value=round(hi, 4),
                meta={"rule": f"share of '{label}' within ±{validate.label_tolerance} of train+val share {share:.3f}"}))
    return suite


def run_suites(frames: Mapping[str, pd.DataFrame], validate: ValidateParams,
               docs_dir: Path | None = None) -> tuple[list[Failure], dict[str, Any]]:
    """Validate every split; return the failures and the raw GX result (JSON-able).

    A throwaway file-backed context is used (not the ephemeral one) because only it can render
    Data Docs; the rendered site is copied to ``docs_dir``.
    """
    import great_expectations as gx  # noqa: PLC0415 - 2.6 s import, only running the suites needs it (not reading failures)
    from great_expectations.checkpoint import UpdateDataDocsAction  # noqa: PLC0415 - as above
    from great_expectations.data_context.types.base import ProgressBarsConfig  # noqa: PLC0415 - as above

    prepared = {s: prepare(f, validate.labels) for s, f in frames.items()}
    root = Path(tempfile.mkdtemp(prefix="gx-"))
    try:
        ctx = gx.get_context(mode="file", project_root_dir=str(root))
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)  # the CLI shows its own
        asset = ctx.data_sources.add_pandas("tasks").add_dataframe_asset("task_table")
        definitions = []
        for split in prepared:
            batch_def = asset.add_batch_definition_whole_dataframe(split)
            suite = ctx.suites.add(build_suite(split, prepared, validate))
            definition = gx.ValidationDefinition(name=f"tasks_{split}", data=batch_def, suite=suite)
            definitions.append(ctx.validation_definitions.add(definition))
        failures: list[Failure] = []
        raw: dict[str, Any] = {}
        for split, vd in zip(prepared, definitions, strict=True):
            checkpoint = ctx.checkpoints.add(gx.Checkpoint(
                name=f"validate_{split}", validation_definitions=[vd],
                actions=[UpdateDataDocsAction(name="docs")] if docs_dir else [],
                result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["id"]},
            ))
            result = checkpoint.run(batch_parameters={"dataframe": prepared[split]})
            for vres in result.run_results.values():
                raw[split] = vres.to_json_dict()
                failures.extend(_failures(split, vres))
        if docs_dir is not None:
            site = root / "gx" / "uncommitted" / "data_docs" / "local_site"
            if site.exists():
                shutil.rmtree(docs_dir, ignore_errors=True)
                shutil.copytree(site, docs_dir)
        return failures, raw
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _failures(split: str, vres: Any) -> list[Failure]:
    out = []
    for res in vres.results:
        if res.success:
            continue
        cfg = res.expectation_config
        column = cfg.kwargs.get("column")
        detail = res.result or {}
        ids, values = [], []
        for item in detail.get("unexpected_index_list") or []:
            if isinstance(item, dict):
                ids.append(str(item.get("id")))
                values.append(item.get(column))
        observed = detail.get("observed_value")
        if res.exception_info and res.exception_info.get("raised_exception"):
            observed = res.exception_info.get("exception_message")
        out.append(Failure(split=split, expectation=cfg.type, column=column, rule=(cfg.meta or {}).get("rule", ""),
                           ids=ids, values=values, observed=observed))
    return out


def quarantine_reasons(failures: list[Failure]) -> dict[tuple[str, str], list[str]]:
    """(split, id) -> reasons, for failures that point at rows."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for f in failures:
        if f.row_level:
            for i in f.ids:
                reasons.setdefault((f.split, i), []).append(f"{f.expectation}({f.column}): {f.rule}")
    return reasons


def failure_dicts(failures: list[Failure]) -> list[dict[str, Any]]:
    return [{**asdict(f), "message": f.describe()} for f in failures]
