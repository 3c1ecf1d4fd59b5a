"""Build the per-role training sets from the rollout traces: SFT chat data, RL prompts, bandit logs.

Reads every ``shard-*.jsonl`` under ``rollouts.out_dir`` through ``pipeline.traces.adapters`` and
writes three DVC outputs under ``datasets.out_dir``:

- ``sft/<role>/train.jsonl``: TRL conversational prompt-completion rows for each role of ``sft.roles``, from its own
  calls
  (``prompt`` = the exact messages sent, ``completion`` = the assistant turn). TRL renders them with
  the base model's own chat template, the same one vLLM applies when serving, and computes the loss
  on the completion only.
- ``rl/hf/`` (Hugging Face dataset for TRL's GRPO) and ``rl/verl/train.parquet`` (verl's RL dataset
  columns: ``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``) for each role of ``ppo.roles``,
  from its trained agents' calls.
- ``bandit/train.jsonl``: one logged supervisor decision per rollout.

Nothing is written unless each one a learner needs is non-empty: an empty one fails the stage with the reasons
the rows were dropped, and the previous outputs stay as they were.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
from datasets import Dataset

from pipeline import metrics_files, tracking
from pipeline.config import DatasetsParams, Params, RolloutsParams, ValidateParams
from pipeline.io import atomic_dir, atomic_path, write_json, write_text
from pipeline.learning import Learning
from pipeline.plots import png
from pipeline.traces import adapters

METRICS_FILE = Path("reports/datasets.json")
PLOT_CSV = Path("reports/plots/rewards.csv")
PLOT_PNG = Path("reports/plots/rewards.png")
OUTPUTS = ("sft", "rl", "bandit")


class EmptyDataset(RuntimeError):
    pass


def _tasks(validate: ValidateParams) -> dict[str, dict[str, Any]]:
    frame = pd.read_parquet(Path(validate.out_dir) / "train.parquet")
    return {str(r["id"]): {**r, "contexts": list(r["contexts"])} for r in frame.to_dict("records")}


def build(rollouts: RolloutsParams, datasets: DatasetsParams, validate: ValidateParams,
          sft_roles: list[str], rl_agents: dict[str, str]) -> dict[str, Any]:
    """All three datasets in memory, with drop counts; raises EmptyDataset naming why one is empty. One role's empty SFT
    set is written empty (its trainer records no_signal); no SFT row for any role fails the stage, as do no RL prompt
    for ``rl_agents`` (agent -> the role that learns from it by RL) and no bandit row."""
    shards = sorted(Path(rollouts.out_dir).glob("shard-*.jsonl"))
    if not shards:
        raise EmptyDataset(f"{rollouts.out_dir}: no shard-*.jsonl trace files; run the rollouts stage first")
    drops = adapters.Drops()
    traces = adapters.read_traces(shards, drops)
    by_role = {role: adapters.sft_examples(traces, datasets, drops, role) for role in sft_roles}
    sets = {
        "sft": [row for rows in by_role.values() for row in rows],
        "rl": adapters.rl_prompts(traces, _tasks(validate), rl_agents, drops),
        "bandit": adapters.bandit_examples(traces, drops),
    }
    wanted = {"sft": bool(sft_roles), "rl": bool(rl_agents), "bandit": True}
    if empty := [name for name in OUTPUTS if not sets[name] and wanted[name]]:
        raise EmptyDataset(_why_empty(empty, shards, traces, drops, datasets))
    return {"traces": traces, "sets": sets, "sft": by_role, "drops": drops, "shards": shards}


# whole Params: the RL roles are ppo's roles, their agents each role's entry
def rl_agents(params: Params) -> dict[str, str]:
    """Agent -> the role that learns from its calls by RL (``ppo.roles.<role>.agents``)."""
    return {a: role for role in params.learners()[Learning.PPO] for a in params.ppo.at(role).agents}


def _why_empty(empty: list[str], shards: list[Path], traces: list[Any], drops: adapters.Drops,
               datasets: DatasetsParams) -> str:
    """Each empty set with the reasons its rows were dropped, and a few examples naming the file and line."""
    lines = []
    for name in empty:
        reasons = {k: v for k, v in drops.counts.items() if k.startswith(f"{name}.") or "." not in k}
        examples = [e for k in reasons for e in drops.examples[k]]
        lines.append(f"  - {name}: 0 rows from {len(traces)} traces; dropped {dict(reasons) or 'nothing (no traces)'}"
                     + "".join(f"\n      {e}" for e in examples[:4]))
    hint = f" (datasets.sft.min_reward={datasets.sft.min_reward})" if "sft" in empty else ""
    return "empty training set(s) from " + ", ".join(map(str, shards)) + f"{hint}:\n" + "\n".join(lines)


def _verl_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"data_source": "pubmedqa_society", "prompt": r["prompt"], "ability": f"{r['role']}/{r['agent']}",
             "reward_model": {"style": "model", "ground_truth": r["label"] or ""},
             "extra_info": {"split": "train", "index": i, "task_id": r["task_id"], "agent": r["agent"],
                            "rollout_id": r["rollout_id"], "question": r["question"], "abstract": r["abstract"]}}
            for i, r in enumerate(rows)]


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def write(datasets: DatasetsParams, built: dict[str, Any]) -> dict[str, Any]:
    out = Path(datasets.out_dir)
    sets = built["sets"]
    with atomic_dir(out / "sft") as tmp:
        for role, rows in built["sft"].items():
            (tmp / role).mkdir()
            write_text(tmp / role / "train.jsonl", _jsonl(rows))
    with atomic_dir(out / "rl") as tmp:
        Dataset.from_list(sets["rl"]).save_to_disk(str(tmp / "hf"))
        (tmp / "verl").mkdir()
        with atomic_path(tmp / "verl" / "train.parquet", suffix=".parquet") as p:
            pd.DataFrame(_verl_rows(sets["rl"])).to_parquet(p, index=False)
    with atomic_dir(out / "bandit") as tmp:
        write_text(tmp / "train.jsonl", _jsonl(sets["bandit"]))
    return summary(built)


def summary(built: dict[str, Any]) -> dict[str, Any]:
    traces, sets = built["traces"], built["sets"]
    sft_rollouts = {r["rollout_id"] for r in sets["sft"]}
    return {
        "traces": len(traces),
        "ok_rollouts": sum(t.status == "ok" for t in traces),
        "task_groups": len({t.task_id for t in traces}),
        "sft.rows": len(sets["sft"]), "sft.rollouts": len(sft_rollouts),
        "sft.by_agent": dict(Counter(r["agent"] for r in sets["sft"])),
        "sft.by_role": {role: len(rows) for role, rows in built["sft"].items()},
        "rl.rows": len(sets["rl"]), "rl.by_agent": dict(Counter(r["agent"] for r in sets["rl"])),
        "bandit.rows": len(sets["bandit"]),
        "bandit.mean_reward": sum(r["reward"] for r in sets["bandit"]) / len(sets["bandit"]),
        "dropped": dict(built["drops"].counts),
        "trace_runs": sorted({t.run_id for t in traces}),
    }


def reward_plots(datasets: DatasetsParams, built: dict[str, Any]) -> None:
    """Histogram of rollout rewards and of those picked for SFT: CSV for `dvc plots`, PNG for MLflow."""
    bins = datasets.reward_bins
    rewards = [t.reward for t in built["traces"] if t.status == "ok" and t.reward is not None]
    chosen = {r["rollout_id"] for r in built["sets"]["sft"]}
    picked = [t.reward for t in built["traces"] if t.rollout_id in chosen and t.reward is not None]
    rows = ["reward_bin,rollouts,selected_for_sft"]
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (lambda v, lo=lo, hi=hi: lo <= v < hi) if b < bins - 1 else (lambda v, lo=lo, hi=hi: lo <= v <= hi)
        rows.append(f"{lo:.2f}-{hi:.2f},{sum(map(inside, rewards))},{sum(map(inside, picked))}")
    write_text(PLOT_CSV, "\n".join(rows) + "\n")
    edges = [b / bins for b in range(bins + 1)]
    with png(PLOT_PNG) as ax:
        ax.hist(rewards, bins=edges, alpha=0.6, label=f"all ok rollouts ({len(rewards)})")
        ax.hist(picked, bins=edges, alpha=0.8, label=f"selected for SFT ({len(picked)})")
        ax.axvline(datasets.sft.min_reward, color="k", ls="--", lw=1, label="datasets.sft.min_reward")
        ax.set_xlabel("final reward (judge, weighted)")
        ax.set_ylabel("rollouts")
        ax.legend(fontsize=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true")


def _report(result: dict[str, Any], built: dict[str, Any]) -> None:
    print(f"datasets: {result['traces']} traces ({result['ok_rollouts']} ok, {result['task_groups']} task groups) -> "
          f"sft {result['sft.rows']} rows from {result['sft.rollouts']} rollouts, rl {result['rl.rows']} prompts, "
          f"bandit {result['bandit.rows']} decisions")
    for reason, count in sorted(result["dropped"].items()):
        examples = built["drops"].examples[reason]
        print(f"  dropped {count:4d} {reason}" + (f"  e.g. {examples[0]}" if examples else ""))


def main(args: argparse.Namespace, params: Params) -> int:
    agents = rl_agents(params)
    try:
        built = build(params.rollouts, params.datasets, params.validate_, params.learners()[Learning.SFT], agents)
    except EmptyDataset as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = write(params.datasets, built)
    reward_plots(params.datasets, built)
    write_json(METRICS_FILE, result)
    metrics_files.write("datasets", result)
    _report(result, built)
    if args.no_mlflow:
        return 0
    with tracking.stage_run("datasets", params.mlflow):
        import mlflow  # noqa: PLC0415 - 1.2 s import, only the MLflow path needs it (not --no-mlflow)

        mlflow.log_params({"sft.min_reward": params.datasets.sft.min_reward, "sft.top_k": params.datasets.sft.top_k,
                           "rl_agents": ",".join(agents),
                           "trace_runs": ",".join(result["trace_runs"])})
        flat = {k: v for k, v in result.items() if isinstance(v, (int, float))}
        flat.update({f"dropped.{k}": v for k, v in result["dropped"].items()})
        mlflow.log_metrics({k: float(v) for k, v in flat.items()})
        mlflow.log_artifact(str(PLOT_PNG), artifact_path="plots")
        mlflow.log_artifact(str(METRICS_FILE))
    return 0
