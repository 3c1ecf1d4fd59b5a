"""Can the gate be fooled, what can it detect, and what does replay buy: measured on the served society.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_learning.py [--tasks 25] [--repeats 5] \
        [--role senior_researcher] [--out docs/benchmarks-learning.md]

Needs the validation split, the index and the model folder (`dvc repro build_index materialize_model`, or
what `make run` leaves); brings the serving stack up from params.yaml. On ``--tasks`` validation questions
(default ``promote.min_tasks``: the n at which the gate starts deciding), in this order:

1. **The champion, whole, ``--repeats`` times** (rollout seeds 0, 1, ...; the judge scores each rollout as
   the rollouts stage does). Every ordered pair of repeats (i as champion, j as candidate) is an A/A
   comparison: the same model against itself, so the gate's ``promoted`` rate over them is its
   false-promotion rate, to be compared with ``promote.alpha``. Decided by ``pipeline.evaluation.gate.decide``
   on the same summaries and paired test ``evaluate`` computes, with the configured ``promote`` section.
2. **The same A/A comparison by replay** (``--repeats`` - 1 candidates; copy j replays repeat j - 1's calls of
   every role but ``--role``, as ``evaluate`` does with ``evaluate.replay``, and is compared with repeat j - 1).
   Its paired differences hold only ``--role``'s own sampling noise. Each copy has its own baseline, so the
   replayed comparisons are independent trials: copies sharing one baseline all regress from the same draw.
3. **What each costs and how much it varies**: LLM calls sent and replayed per task, rollout seconds per task,
   society runs per minute; the standard deviation of the paired reward differences, whole and replayed, and
   the minimum detectable effect at ``--tasks`` from each (one-sided ``promote.alpha``, power 0.8), with the
   task count each way needs to detect a 0.05 reward gain.

4. **The LoRA path** (``--lora``): a LoRA adapter of ``--lora-rank`` on ``sft.lora.target_modules`` (zero-initialised B,
   so it answers as the base does: only the cost differs; made by the model plane with peft) is hot-loaded into
   the worker, and the champion's recorded requests are sent straight to the worker at ``evaluate.concurrency``
   in flight, once by the base model's name and once by the adapter's: throughput ratio, adapter / base.

5. **What a GPU run must reach** (computed, no model runs): on the validation split and the official test split, the
   decision accuracy (yes/no questions) whose exact 95% lower bound clears the majority class, and the interval any
   measured accuracy carries at that n, next to the published references. Run the script under the GPU profile
   (``PIPELINE_PARAMS=params/gpu.yaml``) and its whole report is that profile's.

6. **(c) One role trained on the gold signal, before and after** (``--before-after``): the PI (its calls are the
   senior researcher's logical model) trained with ``train_ppo``'s CPU GRPO trainer on the gold-only reward, and its
   decisions on every yes/no validation question before and after, with the exact McNemar test. This is
   benchmarks/bench_before_after.py's measurement (its options as ``--pi-...``; docs/benchmarks-before-after.md), so
   one run of this script prints all three figures of docs/benchmarks-learning.md. On 2 cores: about 33 min on top.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import bench_before_after  # benchmarks/: part (c)
import psutil
from adapters import make_adapter  # benchmarks/adapters.py
from bench_rollouts import WORKER_HEADERS, replay, replay_requests  # the direct-to-worker replay of recorded requests
from intervals import clopper_pearson
from report import write_report  # benchmarks/report.py (the script's folder is on sys.path)
from rich.progress import Progress

from pipeline.agents.llm import RoleClient
from pipeline.agents.replay import CallBook
from pipeline.agents.rollout import run_with_retries
from pipeline.agents.tools import Toolbox
from pipeline.config import Params, load_params
from pipeline.data.splits import load_tasks
from pipeline.evaluation import gate
from pipeline.evaluation.metrics import CRITERIA, paired_difference, summarise
from pipeline.evaluation.significance import min_tasks_for, minimum_detectable_effect
from pipeline.io import write_json
from pipeline.serving import stack, worker
from pipeline.stages.evaluate import society_cost
from pipeline.traces.schema import Trace


def record(trace: Trace) -> dict[str, Any]:
    """The evaluation record ``evaluate`` scores a trace into (reward and its components from the final span)."""
    final = next((s.data for s in trace.spans if s.kind == "reward" and s.name == "final"), {})
    return {"task_id": trace.task_id, "rollout_id": trace.rollout_id, "label": trace.label, "decision": trace.decision,
            "status": trace.status, "error": trace.error, "reward": float(final.get("value", 0.0)),
            "components": dict(final.get("components") or {}), "scores": {c: float(trace.rewards.get(c, 0.0)) for c in CRITERIA},
            "turns": trace.turns, "tokens": trace.tokens, "latency_s": trace.latency_s}


async def society(params: Params, base_url: str, key: str, tools: Toolbox, tasks: list[dict[str, Any]], seed: int,
                  book: CallBook | None, bar: Progress, bar_id: Any) -> dict[str, Any]:
    """One society over ``tasks`` (judge included), ``evaluate.concurrency`` rollouts in flight; traces and cost."""
    cfg = params.evaluate
    sem = asyncio.Semaphore(cfg.concurrency)
    client = RoleClient.for_agents(params.agents, base_url, key, cfg.timeout_s, replay=book)

    async def one(task: dict[str, Any]) -> Trace:
        ids = {"run_id": "bench_learning", "shard": 0, "task_id": task["id"], "rollout_id": f"{task['id']}-0"}
        async with sem:
            trace = await run_with_retries(params.agents, params.judge, params.reward, client, tools, task, ids, seed, None, None,
                                           cfg.timeout_s, params.rollouts.retries, score=True)
        bar.advance(bar_id)
        return trace

    t0 = time.perf_counter()
    try:
        traces = list(await asyncio.gather(*[one(t) for t in tasks]))
    finally:
        await client.aclose()
    wall = time.perf_counter() - t0
    return {"traces": traces, "records": [record(t) for t in traces], "wall_s": wall, "cost": society_cost(traces),
            "failed": sum(t.status != "ok" for t in traces)}


def compare(params: Params, candidate: dict[str, Any], champion: dict[str, Any]) -> tuple[dict[str, Any], gate.Decision]:
    cfg = params.evaluate
    diff = paired_difference(candidate["records"], champion["records"], cfg.bootstrap, cfg.ci, cfg.seed)
    decision = gate.decide(summarise(candidate["records"], cfg.bootstrap, cfg.ci, cfg.seed),
                           summarise(champion["records"], cfg.bootstrap, cfg.ci, cfg.seed), diff, params.promote)
    return diff, decision


def lora_path(params: Params, traces: list[Trace], rank: int) -> dict[str, Any]:
    """The same recorded requests straight to worker 0, by the base model's name and by a hot-loaded adapter's."""
    w = params.serving.workers[0]
    mix = replay_requests([t.model_dump() for t in traces])
    concurrency = params.evaluate.concurrency
    modules = list(params.sft.lora.target_modules)  # where the trained adapters are (sft.lora), as bench_lora_tax
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as folder:
        make_adapter(w.model, folder, rank, modules, "zero")
        name = f"bench-zero-r{rank}"
        worker.load_lora(w, name, folder)
        WORKER_HEADERS.update(worker.headers(w))
        try:
            base = asyncio.run(replay(worker.base_url(w), mix, concurrency, "base"))
            adapted = [[{**b, "model": name} for b in bodies] for bodies in mix]
            lora = asyncio.run(replay(worker.base_url(w), adapted, concurrency, "lora"))
        finally:
            worker.unload_lora(w, name)
    return {"rank": rank, "modules": modules, "concurrency": concurrency, "base": base, "lora": lora}


def rate(k: int, n: int) -> str:
    """k/n with its exact (Clopper-Pearson) 95% interval: valid at any n."""
    if not n:
        return "no comparisons"
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} = {k / n:.2f} [95% CI {lo:.2f}, {hi:.2f}]"


# Published PubMedQA test-set accuracies (reasoning-required setting, 3 classes): BioGPT paper (Luo et al. 2022) and
# PubMedQA (Jin et al. 2019). Our decision is binary (GO/NO-GO), scored on the yes/no questions only.
REFERENCES = {"fine-tuned BioGPT-Large (1.5B)": 0.810, "fine-tuned BioGPT (347M)": 0.782, "single human": 0.780,
              "majority class (3-class test set)": 0.552}


def accuracy_to_beat(p0: float, n: int, level: float = 0.95) -> float:
    """The smallest accuracy k/n whose exact one-sided ``level`` lower bound exceeds ``p0``."""
    return next((k / n for k in range(n + 1) if clopper_pearson(k, n, 2 * level - 1)[0] > p0), float("nan"))


def targets(params: Params) -> list[str]:
    """What a trained society must reach to be told apart from the majority class, at the validation and test n."""
    val = [t for t in load_tasks(params.validate_, "val") if t["final_decision"] in ("yes", "no")]
    test = [t for t in load_tasks(params.validate_, "test") if t["final_decision"] in ("yes", "no")]
    lines = ["## What a trained society must reach", "",
             "| split | yes/no questions | majority class (yes/no) | accuracy to beat it (exact one-sided 95%) | "
             "95% interval at 0.78 |", "|---|---|---|---|---|"]
    for name, rows in (("validation (the gate's)", val), ("official test", test)):
        n = len(rows)
        if not n:
            continue
        yes = sum(t["final_decision"] == "yes" for t in rows)
        major = max(yes, n - yes) / n
        lo, hi = clopper_pearson(round(0.78 * n), n)
        lines.append(f"| {name} | {n} | {major:.3f} | {accuracy_to_beat(major, n):.3f} | [{lo:.3f}, {hi:.3f}] |")
    lines += ["", "References (PubMedQA test set, 3 classes; ours is scored on its yes/no questions): "
              + "; ".join(f"{k} {v:.1%}" for k, v in REFERENCES.items()) + "."]
    return lines


def rewards_minus(candidate: list[dict[str, Any]], champion: list[dict[str, Any]]) -> list[float]:
    """Per-task reward differences, candidate - champion (the same tasks, in the same order)."""
    return [b["reward"] - a["reward"] for a, b in zip(champion, candidate, strict=True)]


def differences(pairs: list[dict[str, Any]]) -> list[float]:
    return [d for p in pairs for d in p["diffs"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=None, help="validation questions (default promote.min_tasks)")
    ap.add_argument("--repeats", type=int, default=5, help="whole champion societies (ordered pairs = A/A comparisons)")
    ap.add_argument("--role", default="senior_researcher", help="the role a replayed candidate runs live")
    ap.add_argument("--gain", type=float, default=0.05, help="the reward gain whose required task count is reported")
    ap.add_argument("--concurrency", type=int, default=None, help="rollouts in flight (default evaluate.concurrency)")
    ap.add_argument("--min-tasks", type=int, default=None,
                    help="the gate's task floor (default promote.min_tasks); lower it with --tasks to exercise the gate's "
                         "other rules below the configured n (the report says so)")
    ap.add_argument("--before-after", action="store_true",
                    help="(c): the PI trained on the gold reward, before and after (benchmarks/bench_before_after.py; "
                         "its options as --pi-...)")
    bench_before_after.options(ap, "pi-")
    ap.add_argument("--lora", action="store_true", help="also measure the worker's LoRA path on the recorded requests")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    started = time.perf_counter()

    params = load_params()
    candidates = [r for r, spec in params.roles.items() if spec.evaluation.value != "none"]
    if args.role not in candidates:
        # a name no call is made under would leave every call replayed: an A/A of nothing, tying exactly
        ap.error(f"--role {args.role!r}: a candidate's logical model, one of {candidates} (params.yaml roles)")
    if args.concurrency:
        params = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"concurrency": args.concurrency})})
    if args.min_tasks:
        params = params.model_copy(update={"promote": params.promote.model_copy(update={"min_tasks": args.min_tasks})})
    n = args.tasks or params.promote.min_tasks
    base_url, key = stack.ensure(params.serving, params.mlflow)
    tasks = load_tasks(params.validate_, "val", n, rotation="bench_learning")
    tools = Toolbox(params.rollouts.index_dir, params.agents.search_top_k)
    _ = tools.bm25, tools.mesh, tools.genes  # loaded once, not a per-rollout cost
    with Progress(transient=False) as bar:
        whole = [asyncio.run(society(params, base_url, key, tools, tasks, i, None, bar,
                                     bar.add_task(f"champion, whole, seed {i}", total=len(tasks))))
                 for i in range(args.repeats)]
        # a fresh book per candidate (each recorded call answers once per society), from its own baseline
        replayed = [asyncio.run(society(params, base_url, key, tools, tasks, j - 1,
                                        CallBook.from_traces(whole[j - 1]["traces"], live=[args.role]), bar,
                                        bar.add_task(f"copy of seed {j - 1}, replayed but {args.role}", total=len(tasks))))
                    for j in range(1, args.repeats)]

    pairs_whole = []
    for i, j in itertools.permutations(range(args.repeats), 2):
        diff, decision = compare(params, whole[j], whole[i])
        pairs_whole.append({"i": i, "j": j, "diff": diff, "decision": decision,
                            "diffs": rewards_minus(whole[j]["records"], whole[i]["records"])})
    pairs_replay = []
    for j, cand in enumerate(replayed, start=1):
        diff, decision = compare(params, cand, whole[j - 1])
        pairs_replay.append({"i": j - 1, "j": j, "diff": diff, "decision": decision,
                             "diffs": rewards_minus(cand["records"], whole[j - 1]["records"])})
    lora = lora_path(params, whole[0]["traces"], args.lora_rank) if args.lora else None
    before_after = bench_before_after.measure(params, bench_before_after.unprefixed(args, "pi-")) if args.before_after else None
    args.elapsed_min = (time.perf_counter() - started) / 60  # the stack's start included: what a user waits
    lines = render(params, args, n, whole, replayed, pairs_whole, pairs_replay, lora, before_after)
    print("\n".join(lines))
    if args.out:
        write_report(args.out, lines)
        # every society's per-task records beside the report: a question about this run (is one society a low draw
        # that the others regress from?) is answered from the file, not by another hour of rollouts
        write_json(Path(args.out).with_suffix(".json"), {
            "tasks": [t["id"] for t in tasks],
            "whole": [{"seed": i, "records": r["records"]} for i, r in enumerate(whole)],
            "replayed": [{"copy": j, "baseline_seed": j - 1, "live": args.role, "records": r["records"]}
                         for j, r in enumerate(replayed, start=1)],
            "before_after": before_after[1] if before_after else None})


def render(params: Params, args: argparse.Namespace, n: int, whole: list[dict[str, Any]], replayed: list[dict[str, Any]],
           pairs_whole: list[dict[str, Any]], pairs_replay: list[dict[str, Any]], lora: dict[str, Any] | None,
           before_after: tuple[list[str], dict[str, Any]] | None) -> list[str]:
    alpha = params.promote.alpha
    w = params.serving.workers[0]
    lines = [
        "# Benchmark: the gate under A/A comparisons, its detectable effect, and evaluation by replay", "",
        f"`benchmarks/bench_learning.py --tasks {n} --repeats {args.repeats} --role {args.role}"
        f"{f' --min-tasks {args.min_tasks}' if args.min_tasks else ''}"
        f"{f' --concurrency {args.concurrency}' if args.concurrency else ''}"
        f"{' --lora' if args.lora else ''}"
        f"{' --before-after ' + pi_command(args) if args.before_after else ''}`, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}: {psutil.cpu_count()} CPU(s), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB; worker `{w.name}` ({w.model}, max_model_len {w.max_model_len}); "
        f"agents at temperature {params.agents.temperature}, seeded calls {params.agents.seeded_calls}; judge at temperature "
        f"{params.judge.temperature}; reward = {params.reward.judge} judge + {params.reward.decision} decision; "
        f"gate: promote.min_tasks {params.promote.min_tasks}, alpha {alpha}, margin {params.promote.margin}; "
        f"{params.evaluate.concurrency} rollouts in flight; the run took {args.elapsed_min:.0f} min.", "",
        "## (a) False promotions on A/A comparisons", "",
        "| comparison | comparisons | promoted (false promotions) | decisions by rule |", "|---|---|---|---|",
    ]
    for name, pairs in (("whole society vs whole society (other seed)", pairs_whole),
                        (f"replayed copy (only {args.role} sampled) vs the society it replays", pairs_replay)):
        if not pairs:
            continue
        rules: dict[str, int] = {}
        for p in pairs:
            rules[p["decision"].rule] = rules.get(p["decision"].rule, 0) + 1
        k = sum(p["decision"].promote for p in pairs)
        lines.append(f"| {name} | {len(pairs)} | {rate(k, len(pairs))} | "
                     f"{', '.join(f'{r} {c}' for r, c in sorted(rules.items()))} |")
    lines += ["", f"Goal: at most alpha = {alpha}. "
              + " ".join(f"Of the {what} comparisons, {sum(p['diff']['p_value'] < alpha for p in pairs)} of {len(pairs)} had "
                         "a sign-flip p below alpha (the test alone, before the gate's other rules)."
                         for what, pairs in (("whole-society", pairs_whole), ("replayed", pairs_replay)) if pairs), "",
              "## (b) Spread of the paired differences and the minimum detectable effect", "",
              f"| evaluation | paired differences | mean | sd | MDE at n = {n} (one-sided alpha {alpha}, power 0.8) | "
              f"tasks to detect +{args.gain} |", "|---|---|---|---|---|---|"]
    unordered = [p for p in pairs_whole if p["i"] < p["j"]]
    for name, pairs in (("whole (each unordered pair once)", unordered), ("replayed", pairs_replay)):
        d = differences(pairs)
        if len(d) < 2:
            lines.append(f"| {name} | {len(d)} | - | - | - | - |")
            continue
        sd = statistics.stdev(d)
        need = min_tasks_for(args.gain / sd, alpha) if sd > 0 else 1
        lines.append(f"| {name} | {len(d)} | {statistics.fmean(d):+.4f} | {sd:.4f} | "
                     f"{minimum_detectable_effect(sd, n, alpha):.4f} | {need} |")
    means = [f"seed {i} {statistics.fmean(rec['reward'] for rec in r['records']):.3f}" for i, r in enumerate(whole)]
    copy_means = [f"{j} {statistics.fmean(rec['reward'] for rec in r['records']):.3f}" for j, r in enumerate(replayed, start=1)]
    lines += ["", f"Mean reward per society over the {n} tasks: whole {', '.join(means)}"
              + (f"; replayed copies {', '.join(copy_means)}" if copy_means else "") + "."]
    lines += ["", "## Replay against whole societies: cost", "",
              "| society | runs | tasks each | LLM calls sent / task | replayed / task | rollout s / task (mean) | "
              "society runs / min | failed rollouts |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in (("champion, whole", whole), (f"candidate, replayed (live: {args.role})", replayed)):
        if not runs:
            continue
        tasks = sum(len(r["records"]) for r in runs)
        wall = sum(r["wall_s"] for r in runs)
        lat = statistics.fmean(rec["latency_s"] for r in runs for rec in r["records"])
        sent = sum(r["cost"]["live_calls_per_task"] * r["cost"]["tasks"] for r in runs) / tasks
        answered = sum(r["cost"]["replayed_calls_per_task"] * r["cost"]["tasks"] for r in runs) / tasks
        lines.append(f"| {name} | {len(runs)} | {n} | {sent:.1f} | {answered:.1f} | {lat:.1f} | {tasks / wall * 60:.2f} | "
                     f"{sum(r['failed'] for r in runs)} |")
    if whole and replayed:
        cw = sum(r["wall_s"] for r in whole) / sum(len(r["records"]) for r in whole)
        cr = sum(r["wall_s"] for r in replayed) / sum(len(r["records"]) for r in replayed)
        dw, dr = differences([p for p in pairs_whole if p["i"] < p["j"]]), differences(pairs_replay)
        vw = statistics.variance(dw) if len(dw) > 1 else float("nan")
        vr = statistics.variance(dr) if len(dr) > 1 else float("nan")
        lines += ["", f"Replayed / whole: cost per task {cr / cw:.2f}x; variance of the paired difference "
                  f"{(vr / vw) if vw else float('nan'):.2f}x (so the tasks a decision needs scale by the same factor)."]
    if lora:
        b, a = lora["base"], lora["lora"]
        lines += ["", "## The LoRA path", "",
                  f"The champion's recorded requests, {b['requests']} each way, straight to the worker at "
                  f"{lora['concurrency']} in flight.", "",
                  "| served as | requests / s | tokens / s (prompt + generated) | generated tokens / s | p50 latency s |",
                  "|---|---|---|---|---|",
                  f"| base model | {b['req_s']:.2f} | {b['tok_s']:.0f} | {b['gen_tok_s']:.1f} | {b['p50']:.2f} |",
                  f"| LoRA r={lora['rank']} ({', '.join(lora['modules'])}) | {a['req_s']:.2f} | {a['tok_s']:.0f} | "
                  f"{a['gen_tok_s']:.1f} | {a['p50']:.2f} |", "",
                  f"Adapter / base throughput: {a['tok_s'] / b['tok_s']:.2f}x."]
    if before_after:
        lines += ["", "## (c) One role trained on the gold signal: the PI before and after GRPO", "",
                  f"benchmarks/bench_before_after.py's measurement (docs/benchmarks-before-after.md says how to read it): "
                  f"{before_after[0][0]}", "", *[f"#{line}" if line.startswith("## ") else line for line in before_after[0][1:]]]
    lines += ["", *targets(params)]
    return lines


def pi_command(args: argparse.Namespace) -> str:
    """Part (c)'s options as this script takes them."""
    return bench_before_after.command(bench_before_after.unprefixed(args, "pi-")).replace("--", "--pi-")


if __name__ == "__main__":
    main()
