"""Run the society over shards of the validated train split and write one trace line per rollout.

Shard ``i`` takes every ``shards``-th task of the sorted train ids (after ``rollouts.limit``), so a
shard's content depends only on data and params, and the Airflow DAG can map one task per shard.
Each task is rolled out ``rollouts.samples_per_task`` times (a group, rollout ids ``<task>-<k>``,
each with its own exploration seed and sampled completions), so rewards can be compared within a
task (the SFT filter and GRPO need groups). Within a shard, rollouts run concurrently (bounded),
each with a timeout and retries. Finished traces are appended to a journal
(``.shard-XXXXX.jsonl.partial``, fsync per line); a crashed shard resumes from it without repeating
finished rollouts (a truncated last line is ignored), and the final ``shard-XXXXX.jsonl`` is written
atomically from the journal. Rerunning a finished shard replaces it whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import statistics
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pipeline import metrics_files, prompt_registry, tracking
from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import REPOSITORY, Prompts
from pipeline.agents.rollout import run_with_retries, supervisor_policy
from pipeline.agents.tools import Toolbox
from pipeline.config import AgentsParams, JudgeParams, Params, RewardParams, RolloutsParams, ValidateParams
from pipeline.data.splits import load_tasks
from pipeline.io import atomic_open, write_json
from pipeline.progress import Bar, bars
from pipeline.serving import routing, stack

METRICS_FILE = Path("reports/rollouts.json")


def shard_tasks(rollouts: RolloutsParams, validate: ValidateParams, shard: int,
                setting: str | None = None) -> list[dict[str, Any]]:
    return load_tasks(validate, "train", rollouts.limit, setting=setting)[shard :: rollouts.shards]


def rollout_id(task: dict[str, Any], sample: int) -> str:
    """``<task id>-<k>``: which sample of the task's group this rollout is."""
    return f"{task['id']}-{sample}"


def shard_path(rollouts: RolloutsParams, shard: int) -> Path:
    return Path(rollouts.out_dir) / f"shard-{shard:05d}.jsonl"


def journal_path(rollouts: RolloutsParams, shard: int) -> Path:
    final = shard_path(rollouts, shard)
    return final.with_name(f".{final.name}.partial")


def read_journal(path: Path) -> dict[str, str]:
    """rollout_id -> line, for every complete line (a line cut by a crash is dropped; the header has no rollout_id)."""
    done: dict[str, str] = {}
    if not path.exists():
        return done
    for line in path.read_text().splitlines():
        try:
            done[json.loads(line)["rollout_id"]] = line
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def journal_key(agents: AgentsParams, judge: JudgeParams, reward: RewardParams, rollouts: RolloutsParams, shard: int,
                version: Any, tasks: list[dict[str, Any]], prompts: Prompts) -> str:
    """What a journal's rollouts were produced under: a crashed run's rollouts may be resumed only by a run
    with the same society, prompt texts, judge, reward, sampling, routing version and tasks (not e.g. after a
    promotion)."""
    doc = {"agents": agents.model_dump(), "judge": judge.model_dump(), "reward": reward.model_dump(),
           "prompts": {name: prompts.sha(name) for name in sorted(prompts.texts)},
           "rollouts": rollouts.model_dump(include={"seed", "samples_per_task", "shards", "limit", "llm_base_url"}),
           "routing_version": version, "shard": shard, "tasks": [str(t["id"]) for t in tasks],
           "setting": tasks[0].get("setting") if tasks else None}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:24]


def beside(journal: Path, suffix: str) -> Path:
    """A file about a shard's journal kept beside the output folder, not in it (no output of the stage):
    ``data/rollouts/.shard-00000.jsonl.partial`` -> ``data/.rollouts.shard-00000.jsonl.partial<suffix>``."""
    return journal.parent.parent / f".{journal.parent.name}{journal.name}{suffix}"


def open_journal(path: Path, key: str) -> dict[str, str]:
    """The rollouts a crashed run of this same configuration left (``key``), rewritten under its header. A journal
    written under another configuration is set aside (renamed ``*.foreign-<key>``), never merged."""
    text = path.read_text() if path.exists() else ""
    first = text.split("\n", 1)[0]
    try:
        header = json.loads(first).get("journal_config") if first else None
    except (json.JSONDecodeError, AttributeError):
        header = None
    done = read_journal(path)
    if text.strip() and header != key:
        aside = beside(path, f".foreign-{header or 'unversioned'}")
        path.rename(aside)
        print(f"rollouts: {path} was written under another configuration ({header} != {key}); "
              f"set aside as {aside.name}, {len(done)} rollout(s) not reused", file=sys.stderr)
        done = {}
    with atomic_open(path) as fh:  # without a possibly truncated tail, before appending to it
        fh.write(json.dumps({"journal_config": key}) + "\n")
        fh.writelines(line + "\n" for line in done.values())
    return done


@contextlib.contextmanager
def shard_lock(journal: Path) -> Iterator[None]:
    """One writer per shard: a second process on the same shard fails at once instead of interleaving lines. The lock
    file lives beside the output folder, not in it (it is no output, and it outlives the run)."""
    lock = beside(journal, ".lock")
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{journal}: another process is writing this shard (lock {lock} held)") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# whole Params: a shard reads the split, the society, judge and reward, the rollouts settings and the live routing (serving)
async def run_shard(params: Params, shard: int, run_id: str, prompts: Prompts,
                    progress: Bar | None = None) -> list[dict[str, Any]]:
    """A shard's rollouts, the society rendering ``prompts``, journalled so a crashed run resumes where it stopped."""
    tasks = shard_tasks(params.rollouts, params.validate_, shard, params.data.setting)
    journal = journal_path(params.rollouts, shard)
    journal.parent.mkdir(parents=True, exist_ok=True)
    with shard_lock(journal):
        return await _run_shard(params, shard, run_id, tasks, journal, prompts, progress)


# whole Params: run_shard's sections (it is run_shard's body, under the shard's lock)
async def _run_shard(params: Params, shard: int, run_id: str, tasks: list[dict[str, Any]], journal: Path,
                     prompts: Prompts, progress: Bar | None) -> list[dict[str, Any]]:
    base_url, key, version = routing.society_endpoint(params.rollouts, params.serving)
    key_doc = journal_key(params.agents, params.judge, params.reward, params.rollouts, shard, version, tasks, prompts)
    done = open_journal(journal, key_doc)  # a finished shard rerun starts fresh: no journal
    cfg = params.rollouts
    client = RoleClient.for_agents(params.agents, base_url, key, cfg.timeout_s, prompts=prompts)
    tools = Toolbox(cfg.index_dir, params.agents.search_top_k)
    table = routing.active(params.serving) if not params.rollouts.llm_base_url else None
    policy = supervisor_policy(params.agents, params.mlflow, table)
    sem = asyncio.Semaphore(cfg.concurrency)
    lock = asyncio.Lock()
    samples = [(t, k) for t in tasks for k in range(cfg.samples_per_task)]
    order = [rollout_id(t, k) for t, k in samples]
    todo = [(t, k) for t, k in samples if rollout_id(t, k) not in done]
    if progress is not None:
        progress.update(total=len(samples), completed=len(samples) - len(todo))

    async def one(task: dict[str, Any], k: int) -> None:
        ids: dict[str, Any] = {"run_id": run_id, "shard": shard, "task_id": str(task["id"]), "rollout_id": rollout_id(task, k)}
        async with sem:
            trace = await run_with_retries(params.agents, params.judge, params.reward, client, tools, task, ids, cfg.seed,
                                           version, policy, cfg.timeout_s, cfg.retries)
        line = trace.model_dump_json()
        async with lock:
            with open(journal, "a") as fh:  # noqa: ASYNC230 - one fsync'd line; ordering matters more than the stall
                fh.write(line + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            done[ids["rollout_id"]] = line
        if progress is not None:
            progress.advance()

    try:
        await asyncio.gather(*[one(t, k) for t, k in todo])
    finally:
        await client.aclose()
    with atomic_open(shard_path(params.rollouts, shard)) as fh:
        fh.writelines(done[r] + "\n" for r in order)
    journal.unlink()  # noqa: ASYNC240 - one unlink after the last write
    return [json.loads(done[r]) for r in order]


REWARD_PARTS = ("novelty", "feasibility", "impact", "clarity", "groundedness", "efficiency", "aligned", "reward_judge",
                "reward_decision")


def _mean(values: Iterable[float]) -> float:
    """The mean, 0 for none (a metric MLflow and DVC keep numeric)."""
    listed = list(values)
    return statistics.fmean(listed) if listed else 0.0


def summarise(traces: list[dict[str, Any]]) -> dict[str, float]:
    """The pass's figures: success rate, mean turns, tokens and latency of every rollout, mean reward parts of the ok."""
    ok = [t for t in traces if t["status"] == "ok"]
    out: dict[str, float] = {"rollouts": len(traces), "success_rate": _mean(float(t["status"] == "ok") for t in traces)}
    out.update({f"mean_{key}": _mean(t[key] for t in traces) for key in ("turns", "tokens", "latency_s")})
    out["mean_reward"] = _mean(t["reward"] for t in ok if t["reward"] is not None)
    out.update({f"mean_{c}": _mean(vals) for c in REWARD_PARTS if (vals := [t["rewards"][c] for t in ok if c in t["rewards"]])})
    out["maybe_labels"] = sum(t.get("label") == "maybe" for t in traces)
    return out


# whole Params: run_shard's sections
def run(params: Params, shards: list[int], run_id: str, prompts: Prompts = REPOSITORY) -> dict[str, Any]:
    """Every shard at once in one event loop, as the DAG's mapped shard tasks run side by side: the engine batches
    across them (one after another, a default cycle's 4 rollouts had 2 in flight and took twice as long). The society
    renders ``prompts`` (the live routing's; without MLflow, the repository's)."""
    results: dict[str, Any] = {}
    all_traces: list[dict[str, Any]] = []
    with bars() as new:
        shown = {s: new(f"rollouts shard {s}", None) for s in shards}

        async def every() -> list[list[dict[str, Any]]]:
            return list(await asyncio.gather(*(run_shard(params, s, run_id, prompts, shown[s]) for s in shards)))

        for shard, traces in zip(shards, asyncio.run(every()), strict=True):
            results[f"shard_{shard}"] = summarise(traces)
            all_traces += traces
    results["total"] = summarise(all_traces)
    return results


def collect(rollouts: RolloutsParams) -> dict[str, Any]:
    """Metrics over the shard files already written (after mapped per-shard runs)."""
    results, every = {}, []
    for shard in range(rollouts.shards):
        path = shard_path(rollouts, shard)
        if not path.exists():
            raise FileNotFoundError(f"{path}: shard {shard} has not run")
        traces = [json.loads(line) for line in path.read_text().splitlines()]
        results[f"shard_{shard}"] = summarise(traces)
        every += traces
    results["total"] = summarise(every)
    return results


def prune_stale_shards(rollouts: RolloutsParams) -> None:
    """Shard files beyond ``rollouts.shards`` (from an earlier, wider run) would be read as current."""
    for path in Path(rollouts.out_dir).glob("shard-*.jsonl"):
        if int(path.stem.split("-")[1]) >= rollouts.shards:
            path.unlink()


# whole Params: the society's run reads six sections (see run)
def _tracked(params: Params, shard: int | None, shards: list[int], run_id: str) -> dict[str, Any]:
    """The shards run as an MLflow stage run: the routed prompt versions named in spans, the metrics, each shard's
    traces as an artifact and as MLflow traces."""
    with tracking.stage_run("rollouts" if shard is None else f"rollouts-shard-{shard}", params.mlflow):
        import mlflow  # noqa: PLC0415 - 1.2 s import, only the MLflow path needs it (not --no-mlflow, --collect)

        from pipeline.traces.mlflow_traces import log_traces  # noqa: PLC0415 - imports mlflow, as above

        rendered = prompt_registry.sync(params.mlflow, routing.active(params.serving))  # the routed prompt versions
        results = run(params, shards, run_id, rendered)
        for scope, metrics in results.items():
            mlflow.log_metrics({f"{scope}.{k}": float(v) for k, v in metrics.items()})
        for s in shards:
            mlflow.log_artifact(str(shard_path(params.rollouts, s)), artifact_path="traces")
            log_traces([json.loads(line) for line in shard_path(params.rollouts, s).read_text().splitlines()])
    return results


def _failure_reasons(rollouts: RolloutsParams, shards: list[int]) -> dict[str, int]:
    """How often each failed rollout's error (its first 160 characters) occurred in ``shards``."""
    errors: dict[str, int] = {}
    for s in shards:
        for line in shard_path(rollouts, s).read_text().splitlines():
            t = json.loads(line)
            if t["status"] == "failed":
                errors[t["error"][:160]] = errors.get(t["error"][:160], 0) + 1
    return errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard", type=int, default=None, help="run one shard (default: all)")
    parser.add_argument("--collect", action="store_true", help="only compute metrics from existing shard files")
    parser.add_argument("--no-mlflow", action="store_true")


def main(args: argparse.Namespace, params: Params) -> int:
    shards = [args.shard] if args.shard is not None else list(range(params.rollouts.shards))
    if any(not 0 <= s < params.rollouts.shards for s in shards):
        print(f"error: --shard must be in [0, {params.rollouts.shards})", file=sys.stderr)
        return 2
    run_id = tracking.pipeline_run_id()
    if args.shard is None:
        prune_stale_shards(params.rollouts)
    if not params.rollouts.llm_base_url and not args.collect:
        stack.ensure(params.serving, params.mlflow)  # the embedded default's workers + proxy + verified routing
    if args.collect:
        results = collect(params.rollouts)
    elif args.no_mlflow:
        results = run(params, shards, run_id)
    else:
        results = _tracked(params, args.shard, shards, run_id)
    if args.shard is None:
        write_json(METRICS_FILE, results)
        metrics_files.write("rollouts", results)
    total = results["total"]
    failure_rate = 1 - total["success_rate"]
    print(f"rollouts: {int(total['rollouts'])} rollouts, success {total['success_rate']:.0%}, "
          f"mean reward {total['mean_reward']:.3f} -> {params.rollouts.out_dir}/")
    if failure_rate > params.rollouts.max_failure_rate:
        print(f"error: failure rate {failure_rate:.0%} exceeds rollouts.max_failure_rate "
              f"{params.rollouts.max_failure_rate:.0%}; reasons: {json.dumps(_failure_reasons(params.rollouts, shards))}",
              file=sys.stderr)
        return 1
    return 0
