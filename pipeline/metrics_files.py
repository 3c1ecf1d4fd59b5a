"""Headline metrics: a few numbers per stage, and the cycle view ``dvc metrics show`` prints.

Each stage writes a detailed report (``reports/<name>.json``, a plain DVC output) and, through
:func:`write`, ``reports/metrics/<stage>.json``: the keys of that report named in ``HEADLINES``,
flat (``{"total.mean_reward": 0.43}``), at most ``MAX_KEYS`` of them (``dvc metrics show
reports/metrics/<stage>.json``: one stage's row).

The cycle view (``reports/cycle/``, dvc.yaml's only ``metrics:``) answers "how did this cycle go" in a
table a terminal holds: one row per candidate (its promotion key: trainer, signal, evaluated difference
with its interval, p and n, decision) and one for the society (rollouts' reward, the test figure). DVC
draws one column per key of the union of its files, so the rows share a few short keys. It is a pure
function of the stage files (:func:`cycle_view`), rebuilt under a lock after each stage writes its own.

A headline is a dotted path into the report. A dict key that itself holds dots (``"sft.rows"``)
is matched whole; ``*`` matches every key of a dict (``roles.*.diff``: one column per role).
Keys the report lacks this cycle (a no-signal run, a role without a challenger) and ``null``
values are left out; a path that reaches a list or a dict is a mistake in ``HEADLINES`` and raises.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

from pipeline.io import write_json
from pipeline.learning import Learning, candidate_key

DIR = Path("reports/metrics")
MAX_KEYS = 20
CYCLE_DIR = Path("reports/cycle")
SOCIETY = "society"  # the cycle view's row of the society's own figures

_CRITERIA = ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency")

# DVC stage name -> headline keys of its detailed report (see the stage's METRICS_FILE)
HEADLINES: dict[str, tuple[str, ...]] = {
    "ingest": ("rows", "train.rows", "val.rows", "test.rows", "test_ids_missing_from_source"),
    "validate": ("success", "failed_expectations", "quarantined_rows", "train_rows", "val_rows", "test_rows"),
    "materialize_model": ("base.parameters", "base.bytes", "test.parameters"),
    "build_index": ("abstracts", "gene_headings", "protein_headings", "go_genes"),
    "rollouts": ("total.rollouts", "total.success_rate", "total.mean_reward", "total.mean_reward_judge",
                 "total.mean_reward_decision", "total.mean_aligned", "total.maybe_labels", "total.mean_turns",
                 "total.mean_tokens", *(f"total.mean_{c}" for c in _CRITERIA)),
    "datasets": ("traces", "ok_rollouts", "task_groups", "sft.rows", "sft.rollouts", "rl.rows", "bandit.rows",
                 "bandit.mean_reward"),
    "train_sft": ("steps", "train_rows", "eval_rows", "train_loss", "first_loss", "last_loss", "eval_loss_before",
                  "eval_loss", "fit_drop", "held_out_margin_before", "held_out_margin", "held_out_gain_p", "held_out_groups",
                  "tokens_per_s", "no_signal"),
    "train_pi": ("steps", "train_rows", "eval_rows", "train_loss", "fit_loss_before", "fit_loss_after", "fit_drop",
                 "eval_loss_before", "eval_loss", "held_out_before.auc", "held_out.auc", "held_out_gain_p", "no_signal"),
    "train_ppo": ("steps", "prompts", "groups", "completions_scored", "reward_first", "reward_last", "reward_mean",
                  "reward_std", "kl_last", "valid_fraction", "decision_accuracy", "zero_advantage_groups", "no_signal"),
    "train_bandit": ("decisions", "dr_gain", "ope.learned.dr.value", "ope.learned.dr.ci_low", "ope.learned.dr.ci_high",
                     "ope.learned.ips.value", "ope.learned.snips.value", "ope.logging.dr.value", "ope.logging.ips.value",
                     "ope.logging.snips.value"),
    "train_prompt": ("status", "no_signal", "version", "dev.n", "dev.before", "dev.after", "dev.auc_before", "dev.auc_after",
                     "calls", "seconds"),
    "evaluate": ("tasks", "roles.*.candidate_reward", "roles.*.champion_reward", "roles.*.diff", "roles.*.diff_ci_low",
                 "roles.*.diff_ci_high", "roles.*.diff_p_value", "roles.*.n"),
    "promote": ("routing_version", "dry_run", "decisions.*.candidate", "decisions.*.status", "champions.*"),
    "report": ("questions", "official.accuracy", "official.macro_f1", "society.questions", "society.*.yes_no.accuracy",
               "society.*.failures.rate", "society.agreement_with_role_level.rate", "role_level.*.after.yes_no.accuracy",
               "role_level.*.after.official.accuracy", "role_level.*.after.official.macro_f1", "role_level.*.after.auc.value",
               "role_level.*.mcnemar_p", "reward.mean", "success_rate.mean", "routing_version"),
}


def path(stage: str) -> Path:
    """``reports/metrics/<stage>.json``; a foreach stage's ``<kind stage>@<role>`` -> ``<kind stage>/<role>.json``."""
    return DIR / (stage.replace("@", "/") + ".json")


def _resolve(node: Any, parts: list[str], prefix: str) -> list[tuple[str, Any]]:
    if not parts:
        return [(prefix, node)]
    if not isinstance(node, dict):
        return []
    found: list[tuple[str, Any]] = []
    if parts[0] == "*":
        for key, child in node.items():
            found += _resolve(child, parts[1:], f"{prefix}{key}.")
        return found
    for i in range(len(parts), 0, -1):  # the longest key first: "sft.rows" is one key of datasets.json
        key = ".".join(parts[:i])
        if key in node:
            return _resolve(node[key], parts[i:], f"{prefix}{key}.")
    return []


def lookup(report: dict[str, Any], headline: str) -> dict[str, Any]:
    """Every (concrete dotted key, value) a headline names in ``report``; empty when the report lacks it."""
    return {key.rstrip("."): value for key, value in _resolve(report, headline.split("."), "")}


def select(stage: str, report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of one stage's detailed report, flat: a pure function of ``report``."""
    out: dict[str, Any] = {}
    for headline in HEADLINES[stage.partition("@")[0]]:  # one role's stage of a kind: the kind's headlines
        for key, value in lookup(report, headline).items():
            if isinstance(value, (dict, list)):
                raise ValueError(f"metrics_files.HEADLINES[{stage!r}]: {headline!r} names {key!r}, "
                                 f"a {type(value).__name__}, not a number")
            if value is not None:
                out[key] = value
    return out


def write(stage: str, report: dict[str, Any]) -> dict[str, Any]:
    """Write the stage's DVC metrics file (:func:`path`) from its detailed report."""
    headline = select(stage, report)
    write_json(path(stage), headline)
    _refresh_cycle()
    return headline


# the cycle view's columns: stage -> column -> its headline key; a key with ``*`` fills the row of each candidate
# it names, one without fills the society's row. Short names: DVC's table is as wide as the union of the keys.
CYCLE: dict[str, dict[str, str]] = {
    "rollouts": {"rollouts": "total.rollouts", "reward": "total.mean_reward"},
    "evaluate": {"diff": "roles.*.diff", "ci_lo": "roles.*.diff_ci_low", "ci_hi": "roles.*.diff_ci_high",
                 "p": "roles.*.diff_p_value", "n": "roles.*.n"},
    "promote": {"version": "decisions.*.candidate", "decision": "decisions.*.status"},
    "report": {"test.n": "questions", "test.acc": "official.accuracy", "test.f1": "official.macro_f1"},
}


def stage_of(file: Path) -> str:
    """The stage a headline file belongs to (the inverse of :func:`path`)."""
    rel = file.relative_to(DIR).with_suffix("")
    return "@".join(rel.parts)


def cycle_view(headlines: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Row -> its cells, from each stage's headline numbers (stage -> the flat dict :func:`write` wrote)."""
    rows: dict[str, dict[str, Any]] = {}
    for stage, flat in sorted(headlines.items()):
        kind, _, role = stage.partition("@")
        if role and kind.startswith("train_"):  # a trainer fills its candidate's row: what learned, and whether it could
            learning = Learning(kind.removeprefix("train_"))
            rows.setdefault(candidate_key(learning, role), {}).update(trainer=learning.value, signal=not flat.get("no_signal"))
            continue
        for column, key in CYCLE.get(stage, {}).items():
            head, _, tail = key.partition("*")
            for found, value in flat.items():
                if not tail and found == key:
                    rows.setdefault(SOCIETY, {})[column] = value
                elif tail and found.startswith(head) and found.endswith(tail) and len(found) > len(head) + len(tail):
                    rows.setdefault(found[len(head):-len(tail)], {})[column] = value
    return rows


def _refresh_cycle() -> None:
    """Rebuild ``reports/cycle/`` from every stage file present. Under a lock, after this stage's own write: the
    last of concurrent stages (parallel trainers) reads everything the others wrote."""
    DIR.mkdir(parents=True, exist_ok=True)
    with (DIR.parent / ".cycle.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        headlines = {stage_of(f): json.loads(f.read_text()) for f in sorted(DIR.rglob("*.json"))}
        rows = cycle_view(headlines)
        CYCLE_DIR.mkdir(parents=True, exist_ok=True)
        for stale in CYCLE_DIR.glob("*.json"):
            if stale.stem not in rows:
                stale.unlink()
        for row, cells in rows.items():
            write_json(CYCLE_DIR / f"{row}.json", dict(sorted(cells.items())))
