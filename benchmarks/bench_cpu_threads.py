"""A CPU vLLM worker's decoding beside busy neighbours, per OpenMP binding (whether a worker that shares its cores
should bind fewer OpenMP threads than vLLM's "auto", one per core).

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_cpu_threads.py [--binds auto 0] [--out docs/benchmarks-cpu-threads.md]

Starts the first worker of params.yaml (its own argv and environment, ``pipeline.serving.worker``; materialise the
model first) once per ``VLLM_CPU_OMP_THREADS_BIND`` value, and measures generated tokens/s (fixed length, ignore_eos)
at concurrency 1 and 6 with nothing else running, beside one and two busy Python processes (what a test process or
the proxy is) and beside a two-thread torch loop (what a trainer is). Prints each figure and its ratio to ``auto``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from bench_serving import throughput
from report import publish

from pipeline.config import load_params
from pipeline.envs import model_python, pythonpath
from pipeline.services.process import free_port
from pipeline.serving import worker as worker_mod

BUSY = "while True: pass"
TORCH = ("import torch, time\na = torch.randn(256, 256)\n"
         "while True:\n    for _ in range(50): a = torch.tanh(a @ a)\n    time.sleep(0.01)\n")
NEIGHBOURS = {"none": [], "1 busy process": [(sys.executable, BUSY)], "2 busy processes": [(sys.executable, BUSY)] * 2,
              "torch, 2 threads": [(model_python(), TORCH)]}


def boot(bind: str, port: int, key: str) -> subprocess.Popen:
    params = load_params()
    w = params.serving.workers[0].model_copy(update={"port": port})
    env = {**os.environ, **worker_mod.environment(params.serving, w), "VLLM_CPU_OMP_THREADS_BIND": bind,
           "VLLM_API_KEY": key, "PYTHONPATH": pythonpath()}  # as worker.up starts it (the guard is imported from here)
    log = Path(params.serving.home) / f"bench-cpu-threads-{bind}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    worker_mod.adapter_cache(params.serving).mkdir(parents=True, exist_ok=True)  # vLLM's resolver needs it, as in up
    with log.open("w") as out:  # the worker's own log, named when it does not come up
        proc = subprocess.Popen(worker_mod.command(w, model_python()), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker (bind {bind}) exited with {proc.returncode}: {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, 9)  # the worker's engine processes too
    raise SystemExit(f"worker (bind {bind}) not healthy in 600 s: {log}")


def measure(port: int, key: str, model: str, neighbours: list[tuple[str, str]], max_tokens: int) -> dict[str, float]:
    procs = [subprocess.Popen([python, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "2"}) for python, code in neighbours]
    try:
        time.sleep(2 if procs else 0)  # the neighbours past their imports
        url, headers = f"http://127.0.0.1:{port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}
        return {f"c{c}": asyncio.run(throughput(url, model, headers, c, c, max_tokens)) for c in (1, 6)}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binds", nargs="+", default=["auto", "0"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="docs/benchmarks-cpu-threads.md")
    args = parser.parse_args()
    model = worker_mod.served_name(load_params().serving.workers[0])
    key, figures = secrets.token_urlsafe(16), {}
    for bind in args.binds:
        port = free_port()
        proc = boot(bind, port, key)
        try:
            measure(port, key, model, [], 16)  # warm-up
            for name, neighbours in NEIGHBOURS.items():
                figures[(bind, name)] = measure(port, key, model, neighbours, args.max_tokens)
                print(bind, name, {k: round(v, 1) for k, v in figures[(bind, name)].items()}, flush=True)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)
    ref = args.binds[0]
    lines = [f"# A CPU vLLM worker beside busy neighbours, per OpenMP binding (`{Path(__file__).name}`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs: the first "
             f"worker of params.yaml, {args.max_tokens} generated tokens per request (ignore_eos), tokens/s summed over "
             f"the requests in flight; ratio to `VLLM_CPU_OMP_THREADS_BIND={ref}`.", "",
             "| neighbours | " + " | ".join(f"bind `{b}`, 1 / 6 in flight" for b in args.binds) + " | ratio, 1 / 6 |",
             "| --- | " + " | ".join("---" for _ in args.binds) + " | --- |"]
    for name in NEIGHBOURS:
        cells = [f"{figures[(b, name)]['c1']:.1f} / {figures[(b, name)]['c6']:.1f}" for b in args.binds]
        last = figures[(args.binds[-1], name)]
        ratio = f"{last['c1'] / figures[(ref, name)]['c1']:.2f} / {last['c6'] / figures[(ref, name)]['c6']:.2f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    publish(args.out, lines, {"binds": args.binds, "max_tokens": args.max_tokens,
                              "figures": [{"bind": b, "neighbours": n, **v} for (b, n), v in figures.items()]})


if __name__ == "__main__":
    main()
