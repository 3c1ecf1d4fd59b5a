"""What the control plane's Prompt Registry reads cost: requests and seconds per call of what every stage start and
every serving check pay (``prompt_registry.sync``, the promotion audit's champion read), against the same reads made
with MLflow's ``load_prompt`` per template (four or five requests a version).

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_registry_reads.py [--repeats 5] [--out FILE.md]

Starts the project's MLflow server as the CLI does (``mlflow_server.ensure``), registers the templates once (a first
``sync``), then times each read ``--repeats`` times and counts its HTTP requests. Prints each figure and the ratio of
``load_prompt``'s cost to the one-request read's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import mlflow.genai
import requests
from report import publish

from pipeline import prompt_registry, tracking
from pipeline.agents import prompts
from pipeline.config import load_params
from pipeline.services import mlflow_server


def measure(read: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median seconds and requests per call of ``read``."""
    sent = 0
    real = requests.Session.request

    def counted(self: requests.Session, *args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        return real(self, *args, **kwargs)

    seconds = []
    with mock.patch.object(requests.Session, "request", counted):
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "requests": sent / repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/benchmarks-registry-reads.md")
    args = parser.parse_args()
    params = load_params()
    mlflow_server.ensure(params.mlflow)
    tracking.setup(params.mlflow)
    prompt_registry.sync(params.mlflow)  # every template registered: what follows reads only

    def per_template(*aliases: str) -> Callable[[], Any]:
        return lambda: [mlflow.genai.load_prompt(f"prompts:/{prompt_registry.registered_name(t)}@{alias}",
                                                 allow_missing=True, **prompt_registry.FRESH)
                        for t in prompts.TEMPLATES for alias in aliases]

    # the reference reads what sync read before (#54): each template's repository and champion versions
    champion, repository = prompt_registry.CHAMPION, prompt_registry.REPOSITORY
    rows = [("the templates' repository versions and champions (sync, every stage start)",
             lambda: prompt_registry.sync(params.mlflow), per_template(repository, champion)),
            ("the templates' champions (the serving check's audit)",
             lambda: prompt_registry.aliased(champion, prompts.TEMPLATES), per_template(champion))]
    figures = []
    for name, ours, reference in rows:
        a, b = measure(ours, args.repeats), measure(reference, args.repeats)
        figures.append({"read": name, "one_search": a, "load_prompt_each": b})
        print(name, a, b, flush=True)
    lines = [f"# Prompt Registry reads per call (`{os.path.basename(__file__)}`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs, the "
             f"project's MLflow server (basic auth, SQLite) on loopback, nothing else running; {len(prompts.TEMPLATES)} "
             f"templates, median of {args.repeats} calls. `sync` also sets the experiment (one request of its own).", "",
             "| read | one search: requests / s | `load_prompt` per template and alias: requests / s | ratio (s) |",
             "| --- | --- | --- | --- |"]
    for f in figures:
        a, b = f["one_search"], f["load_prompt_each"]
        lines.append(f"| {f['read']} | {a['requests']:.0f} / {a['seconds']:.3f} | {b['requests']:.0f} / {b['seconds']:.3f} | "
                     f"{b['seconds'] / a['seconds']:.1f}x |")
    publish(args.out, lines, {"templates": len(prompts.TEMPLATES), "repeats": args.repeats, "figures": figures})


if __name__ == "__main__":
    main()
