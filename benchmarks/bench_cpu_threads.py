"""A CPU vLLM worker's decoding beside busy neighbours, per OpenMP binding (whether a worker that shares its cores
should bind fewer OpenMP threads than vLLM's "auto", one per core).

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_cpu_threads.py [--binds auto 0] [--out docs/benchmarks-cpu-threads.md]

Starts the first worker of params.yaml (``worker.up``: its own argv, environment and key; materialise the model
first) under a name and port of its own, once per ``VLLM_CPU_OMP_THREADS_BIND`` value, and measures generated tokens/s
(fixed length, ignore_eos) at concurrency 1 and 6 with nothing else running, beside one and two busy Python processes
(what a test process or the proxy is) and beside a two-thread torch loop (what a trainer is). Prints each figure and its
ratio to ``auto``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

from bench_serving import throughput
from report import publish

from pipeline.config import load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from pipeline.serving import worker as worker_mod

BUSY = "while True: pass"
TORCH = ("import torch, time\na = torch.randn(256, 256)\n"
         "while True:\n    for _ in range(50): a = torch.tanh(a @ a)\n    time.sleep(0.01)\n")
NEIGHBOURS = {"none": [], "1 busy process": [(sys.executable, BUSY)], "2 busy processes": [(sys.executable, BUSY)] * 2,
              "torch, 2 threads": [(model_python(), TORCH)]}


@contextlib.contextmanager
def serving(bind: str) -> Iterator[tuple[str, dict[str, str], str]]:
    """The first worker of params.yaml under a name and port of its own (a live ``base`` worker is left alone), started
    by the project's ``worker.up`` (its argv, environment, key and health wait) with ``bind`` in the environment it
    passes on; yields its chat URL, headers and model name, and stops it with ``worker.down``."""
    params = load_params()
    w = params.serving.workers[0].model_copy(update={"name": "bench-cpu-threads", "port": free_port()})
    with mock.patch.dict(os.environ, {"VLLM_CPU_OMP_THREADS_BIND": bind}):
        worker_mod.up(params.serving, w)
    try:
        yield f"{worker_mod.base_url(w)}/v1/chat/completions", worker_mod.headers(w), worker_mod.served_name(w)
    finally:
        worker_mod.down(params.serving, w)


def measure(url: str, headers: dict[str, str], model: str, neighbours: list[tuple[str, str]],
            max_tokens: int) -> dict[str, float]:
    procs = [subprocess.Popen([python, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "2"}) for python, code in neighbours]
    try:
        time.sleep(2 if procs else 0)  # the neighbours past their imports
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
    figures = {}
    for bind in args.binds:
        with serving(bind) as (url, headers, model):
            measure(url, headers, model, [], 16)  # warm-up
            for name, neighbours in NEIGHBOURS.items():
                figures[(bind, name)] = measure(url, headers, model, neighbours, args.max_tokens)
                print(bind, name, {k: round(v, 1) for k, v in figures[(bind, name)].items()}, flush=True)
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
