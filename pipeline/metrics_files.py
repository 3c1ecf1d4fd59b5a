"""Headline metrics for ``dvc metrics show/diff`` and ``dvc exp show``: a few numbers per stage.

Each stage writes a detailed report (``reports/<name>.json``, a plain DVC output) and, through
:func:`write`, ``reports/metrics/<stage>.json``: the keys of that report named in ``HEADLINES``,
flat (``{"total.mean_reward": 0.43}``), at most ``MAX_KEYS`` of them, so DVC's metrics table and
experiment table stay readable and comparable across runs.

A headline is a dotted path into the report. A dict key that itself holds dots (``"sft.rows"``)
is matched whole; ``*`` matches every key of a dict (``roles.*.diff``: one column per role).
Keys the report lacks this cycle (a no-signal run, a role without a challenger) and ``null``
values are left out; a path that reaches a list or a dict is a mistake in ``HEADLINES`` and raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.io import write_json

DIR = Path("reports/metrics")
MAX_KEYS = 20

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
                  "eval_loss", "tokens_per_s"),
    "train_pi": ("steps", "train_rows", "eval_rows", "train_loss", "fit_loss_before", "fit_loss_after", "fit_drop",
                 "eval_loss_before", "eval_loss", "no_signal"),
    "train_ppo": ("steps", "prompts", "groups", "completions_scored", "reward_first", "reward_last", "reward_mean",
                  "reward_std", "kl_last", "valid_fraction", "decision_accuracy", "zero_advantage_groups", "no_signal"),
    "train_bandit": ("decisions", "dr_gain", "ope.learned.dr.value", "ope.learned.dr.ci_low", "ope.learned.dr.ci_high",
                     "ope.learned.ips.value", "ope.learned.snips.value", "ope.logging.dr.value", "ope.logging.ips.value",
                     "ope.logging.snips.value"),
    "train_prompt": ("status", "no_signal", "version", "dev.n", "dev.before", "dev.after", "dev.auc_before", "dev.auc_after",
                     "calls", "seconds"),
    "evaluate": ("tasks", "roles.*.candidate_reward", "roles.*.champion_reward", "roles.*.diff", "roles.*.diff_p_value",
                 "roles.*.decision_p_value"),
    "promote": ("routing_version", "dry_run", "decisions.*.status", "champions.*"),
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
    return headline
