"""vLLM's reader spin on a 2-core host: the worker as `pipeline.serving.worker` starts it, with the shared-memory
message queue's busy-wait window at vLLM's hard-coded 1 s against a short one, same requests, interleaved A B A B.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_vllm_spin.py [--windows 1 0.002] [--repeats 2]

vLLM 0.32's ``shm_broadcast.SpinCondition`` makes a reader (the engine core waiting for the worker's output, the worker
waiting for the next step) call ``sched_yield`` in a loop for ``busy_loop_s`` (1 s, not configurable) after every read
before it sleeps on a socket. Under load a read comes every step, so both processes spin between steps; on a GPU
server that is an idle core, here it is one of the two cores the forward pass wants (upstream: vllm-project/vllm#52814,
open). The short window is set by a ``sitecustomize`` on the worker's ``PYTHONPATH`` that changes that one default
when vLLM imports the module (every process of the worker, spawned children included); nothing in the product uses it.
Needs the base model (``python -m pipeline materialize-model``) and the PubMedQA file of params.yaml.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from bench_rollouts import group_cpu  # the CPU of a worker's whole process group

from pipeline.config import load_params
from pipeline.envs import model_python, pythonpath
from pipeline.services.process import free_port
from pipeline.serving import worker as workers

HOOK = '''import importlib.abc, importlib.util, os, sys
_W = float(os.environ["BENCH_SHM_BUSY_LOOP_S"])
_NAME = "vllm.distributed.device_communicators.shm_broadcast"
class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            init = module.SpinCondition.__init__
            init.__defaults__ = (*init.__defaults__[:-1], _W)
            print(f"bench_vllm_spin: busy_loop_s default {_W} in pid {os.getpid()}", file=sys.stderr, flush=True)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Hook())
'''


def prompts(source: Path, n: int) -> list[list[dict[str, str]]]:
    rows = list(json.loads(source.read_text()).values())[:n]
    return [[{"role": "user", "content": f"Question: {r['QUESTION']}\nContext: {' '.join(r['CONTEXTS'])}\n"
              "Propose one testable hypothesis and how to test it."}] for r in rows]


async def load(url: str, key: str, model: str, msgs: list[list[dict[str, str]]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900, headers={"Authorization": f"Bearer {key}"}) as client:
        async def one(i: int, m: list[dict[str, str]]) -> tuple[int, float]:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/chat/completions", json={
                    "model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                    "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"], time.perf_counter() - t0
        t0 = time.perf_counter()
        done = await asyncio.gather(*[one(i, m) for i, m in enumerate(msgs)])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(d[0] for d in done), "p50_s": statistics.median(d[1] for d in done)}


def measure(window: float, args: argparse.Namespace, msgs: list[list[dict[str, str]]]) -> dict:
    params = load_params()
    w = params.serving.workers[0].model_copy(update={"port": free_port(), "lora_modules": {}})
    key, hook_dir = secrets.token_hex(16), Path(tempfile.mkdtemp(prefix="spin-"))
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, **workers.environment(params.serving, w), workers.KEY_ENV: key,
           "PYTHONPATH": f"{hook_dir}{os.pathsep}{pythonpath()}", "BENCH_SHM_BUSY_LOOP_S": str(window)}
    workers.adapter_cache(params.serving).mkdir(parents=True, exist_ok=True)  # vLLM's resolver plugin wants it, as `up` makes it
    log = (hook_dir / "worker.log").open("w")
    proc = subprocess.Popen(workers.command(w, model_python()), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://{w.host}:{w.port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (hook_dir / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "worker never healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        patched = (hook_dir / "worker.log").read_text().count("bench_vllm_spin: busy_loop_s")
        out: dict = {"window_s": window, "patched_processes": patched}
        asyncio.run(load(url, key, workers.served_name(w), msgs[:2], 2, 8))  # warm-up
        for c, n in ((1, args.serial), (8, args.parallel)):
            cpu0 = group_cpu(proc.pid)
            r = asyncio.run(load(url, key, workers.served_name(w), msgs[:n], c, args.max_tokens))
            cpu = group_cpu(proc.pid) - cpu0
            out[f"c{c}"] = {**r, "tok_s": r["tokens"] / r["wall_s"], "engine_cpu_s": cpu,
                            "engine_cores": cpu / r["wall_s"]}
        cpu0 = group_cpu(proc.pid)
        time.sleep(10)
        out["idle_cores"] = (group_cpu(proc.pid) - cpu0) / 10
        return out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=float, nargs="+", default=[1.0, 0.002])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--serial", type=int, default=4, help="requests at 1 in flight")
    ap.add_argument("--parallel", type=int, default=16, help="requests at 8 in flight")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="docs/benchmarks-vllm-spin.json")
    args = ap.parse_args()
    params = load_params()
    msgs = prompts(Path(params.data.source), max(args.serial, args.parallel))
    runs = []
    for rep in range(args.repeats):
        for window in args.windows:
            r = measure(window, args, msgs)
            runs.append({"repeat": rep, **r})
            print(json.dumps(runs[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    lines = ["| window s | repeat | processes patched | 1 in flight tok/s | its engine cores | 8 in flight tok/s "
             "| its engine cores | idle engine cores |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['window_s']:g} | {r['repeat']} | {r['patched_processes']} | {r['c1']['tok_s']:.1f} | "
              f"{r['c1']['engine_cores']:.2f} | {r['c8']['tok_s']:.1f} | {r['c8']['engine_cores']:.2f} | {r['idle_cores']:.2f} |"
              for r in runs]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
