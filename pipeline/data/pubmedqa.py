"""PubMedQA PQA-L -> the task table every later stage reads.

Both published layouts are accepted: the original ``ori_pqal.json`` (PMID -> record with upper-case
keys) and the Hugging Face ``pqa_labeled`` rows (``pubid``, nested ``context``). Normalising never
drops or repairs a row: a missing field becomes null and a bad value is kept as is, so that
``validate`` can name it instead of it vanishing here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from pipeline.data.sources import SourceError, check_allowed, read_bytes

if TYPE_CHECKING:
    from pipeline.config import SourceAllowParams, ValidateParams

COLUMNS = ["id", "question", "contexts", "labels", "meshes", "long_answer", "final_decision", "year"]
SPLITS = ("train", "val", "test")


def _pairs_keep_duplicates(pairs: list[tuple[str, Any]]) -> Any:
    # json.load keeps only the last of duplicate keys; keep them all so duplicates reach validate.
    return pairs


def _as_list(value: Any, name: str) -> list[str] | None:
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name}: {_shown(value)}: must be a list of strings")
    return list(value)


def _text_or_none(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name}: {_shown(value)}: must be a string")
    return value


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _shown(value: Any) -> str:
    """A value as a one-line message shows it: absent (None, or pandas' NaN for a missing cell) is 'missing'."""
    if value is None or (isinstance(value, float) and value != value):
        return "missing"
    return repr(value[:20]) if isinstance(value, str) else repr(value)[:20]


def normalise_record(pmid: str, rec: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the task table from either layout; a field of the wrong type (a number for the question, an object for
    the contexts) raises ValueError naming it: a missing or bad value within its type is left to the checks."""
    ctx = rec.get("context")
    if isinstance(ctx, Mapping):  # Hugging Face layout
        contexts, labels, meshes = ctx.get("contexts"), ctx.get("labels"), ctx.get("meshes")
    else:
        contexts, labels, meshes = rec.get("CONTEXTS"), rec.get("LABELS"), rec.get("MESHES")
    return {
        "id": str(pmid),
        "question": _text_or_none(rec.get("QUESTION", rec.get("question")), "question"),
        "contexts": _as_list(contexts, "contexts"),
        "labels": _as_list(labels, "labels"),
        "meshes": _as_list(meshes, "meshes"),
        "long_answer": _text_or_none(rec.get("LONG_ANSWER", rec.get("long_answer")), "long_answer"),
        "final_decision": _text_or_none(rec.get("final_decision"), "final_decision"),
        "year": _str_or_none(rec.get("YEAR", rec.get("year"))),
    }


def _text(raw: bytes, origin: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{origin}: byte {exc.start}: not UTF-8 ({exc.reason})") from None


def _records_from_json(raw: bytes, origin: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    try:
        doc = json.loads(_text(raw, origin), object_pairs_hook=_pairs_keep_duplicates)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{origin}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from exc
    except RecursionError:
        raise SourceError(f"{origin}: JSON nested too deeply (PQA-L records are three levels deep)") from None
    if isinstance(doc, list) and all(isinstance(p, tuple) for p in doc):  # top-level object
        for n, (pmid, rec) in enumerate(doc):
            if not isinstance(rec, list):
                raise SourceError(f"{origin}: entry #{n} (id {pmid}) is not an object")
            yield pmid, _deep_dict(rec) if rec else {}
        return
    if isinstance(doc, list):  # list of HF-style rows
        for n, raw in enumerate(doc):
            rec = _deep_dict(raw) if isinstance(raw, list) else raw
            if not isinstance(rec, dict) or "pubid" not in rec:
                raise SourceError(f"{origin}: row #{n} has no 'pubid'")
            yield str(rec["pubid"]), rec
        return
    raise SourceError(f"{origin}: expected an object of PMID -> record or a list of rows")


def _deep_dict(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return {k: _deep_dict(v) for k, v in value}
    if isinstance(value, list):
        return [_deep_dict(v) for v in value]
    return value


def load_tasks(source: str, hf_split: str = "train", allow: SourceAllowParams | None = None,
               sha256: str | None = None) -> pd.DataFrame:
    """Read PQA-L from any supported source into the (unsplit) task table (``allow``: what sources may be)."""
    if source.startswith("hf://"):
        if allow is not None:
            check_allowed(source, allow)
        rows = _load_hf(source[len("hf://"):], hf_split)
    else:
        rows = _normalised(_records_from_json(read_bytes(source, allow=allow, sha256=sha256), source), source)
    if not rows:
        raise SourceError(f"{source}: no records")
    return pd.DataFrame(rows, columns=COLUMNS)


def _normalised(records: Iterable[tuple[str, Mapping[str, Any]]], origin: str) -> list[dict[str, Any]]:
    rows = []
    for n, (pmid, rec) in enumerate(records):
        try:
            rows.append(normalise_record(pmid, rec))
        except ValueError as exc:
            raise SourceError(f"{origin}: row {n} (id {pmid}): {exc}") from None
    return rows


def _load_hf(spec: str, split: str) -> list[dict[str, Any]]:
    import datasets  # noqa: PLC0415 - 0.7 s import, only hf:// sources need it

    spec, _, revision = spec.partition("@")  # hf://<id>[:<config>][@<revision>]: pin a commit for reproducible ingests
    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None, split=split, revision=revision or None)
    return _normalised(((str(r["pubid"]), r) for r in ds), f"hf://{spec}")


def load_test_ids(uri: str, allow: SourceAllowParams | None = None) -> dict[str, str]:
    try:
        doc = json.loads(_text(read_bytes(uri, allow=allow), uri))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{uri}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except RecursionError:
        raise SourceError(f"{uri}: JSON nested too deeply (expected an object of PMID -> label)") from None
    if not isinstance(doc, dict):
        raise SourceError(f"{uri}: expected an object of PMID -> label")
    return {str(k): str(v) for k, v in doc.items()}


YEAR = re.compile(r"[12][0-9]{3}")


MAX_PROBLEMS = 20  # named one line each; the rest are counted


def check_rows(tasks: pd.DataFrame, origin: str, validate: ValidateParams) -> None:
    """What must hold before a table replaces the stored one: a year is four digits or absent (never NaN or inf), a PMID
    has one label (a duplicate with another label would make the gold answer depend on row order), and, unless
    ``validate.quarantine`` will set bad rows aside, every label is one of ``validate.labels`` and no question or
    context is longer than ``validate``'s caps. Raises once, naming every bad row's file, row, field and rule (the
    first ``MAX_PROBLEMS``, then the count), so a user fixes a file in one pass."""
    problems = [f"{origin}: row {n} (id {row.id}): {why}" for n, row in enumerate(tasks.itertuples(index=False))
                for why in _row_problems(row, validate)]
    first: dict[str, tuple[int, Any]] = {}
    for n, (pmid, label) in enumerate(zip(tasks["id"], tasks["final_decision"], strict=True)):
        was, was_label = first.setdefault(pmid, (n, label))
        if was != n and was_label != label and not validate.quarantine:  # the same label twice: validate's unique-id rule
            problems.append(f"{origin}: row {n} (id {pmid}): label {str(label)[:20]!r} where row {was} has "
                            f"{str(was_label)[:20]!r}: a PMID has one answer")
    if problems:
        more = f"\n... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        head = f"{origin}: {len(problems)} problem(s), nothing stored changed:\n" if len(problems) > 1 else ""
        raise SourceError(head + "\n".join(problems[:MAX_PROBLEMS]) + more)


def _row_problems(row: Any, validate: ValidateParams) -> list[str]:
    caps = {"question": validate.question_chars.max, "contexts": validate.context_chars.max}
    found = []
    if isinstance(row.year, str) and not YEAR.fullmatch(row.year):  # absent is None (or pandas' NaN): allowed
        found.append(f"year {str(row.year)[:20]!r}: must be a four-digit year or absent")
    if validate.quarantine:
        return found
    if row.final_decision not in validate.labels:
        found.append(f"final_decision {_shown(row.final_decision)}: must be one of {validate.labels}")
    if not isinstance(row.question, str) or not row.question.strip():
        found.append(f"question: {'empty' if isinstance(row.question, str) else 'missing'}")
    elif len(row.question) > caps["question"]:
        found.append(f"question: {len(row.question)} characters > validate.question_chars.max {caps['question']}")
    if (size := sum(len(c) for c in (row.contexts if isinstance(row.contexts, list) else []))) > caps["contexts"]:
        found.append(f"contexts: {size} characters > validate.context_chars.max {caps['contexts']}")
    return found


def split_tasks(tasks: pd.DataFrame, test_ids: Mapping[str, str], val_fraction: float, seed: int) -> pd.DataFrame:
    """Add ``split``: official test ids -> test; the rest split train/val stratified by label.

    Stratification is done per label on sorted ids with one seeded generator, so the split depends
    only on the data, the fraction and the seed (not on input order).
    """
    out = tasks.copy()
    out["split"] = np.where(out["id"].isin(set(test_ids)), "test", "train")
    rng = np.random.default_rng(seed)
    rest = out[out["split"] != "test"]
    for _label, group in sorted(rest.groupby(rest["final_decision"].fillna("<null>")), key=lambda kv: kv[0]):
        ids = np.array(sorted(group["id"].unique()))
        rng.shuffle(ids)
        n_val = round(len(ids) * val_fraction)
        out.loc[out["id"].isin(set(ids[:n_val])) & (out["split"] != "test"), "split"] = "val"
    return out
