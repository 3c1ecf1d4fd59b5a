"""The report's society under serving settings, paired: each arm a worker restart, arms alternated on one host.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_society_arms.py --params params/learn.yaml --questions 20 \
        --arm xgrammar:serving.worker_defaults.structured_backend=xgrammar \
        --arm guidance:serving.worker_defaults.structured_backend=guidance --rounds 2 [--out docs/benchmarks-society-arms.md]

Needs what `make learn`'s first step leaves (validated data, the model folder, the tools index) and MLflow up. Each arm
restarts the serving stack with its overrides (``PIPELINE__`` environment, as any one-off run) and runs
``python -m pipeline report`` on the first ``--questions`` test questions with the live routing, society only (no
role-level readout), exactly as `make learn`'s report runs its societies (``evaluate.concurrency`` in flight, the judge
scoring each). Arms are alternated ``--rounds`` times, so the host's hour falls on every arm alike. Per run: the
societies' seconds (the report's own ``cost``), tokens a society, failures, yes/no accuracy and mean reward, and the
worker's last logged prefix-cache hit rate. Settings that change the served answers show it in tokens and reward.
The checkout's own report files (what ``pipeline report`` rewrites) are put back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import publish

from pipeline.contracts import TestReport, read

ROOT = Path(__file__).resolve().parents[1]
HIT = re.compile(r"Prefix cache hit rate: ([0-9.]+)%")
REPORTS = ("reports/test.json", "reports/test", "reports/metrics/report.json")  # what `pipeline report` rewrites


def env_of(overrides: list[str], base: dict[str, str]) -> dict[str, str]:
    """``section.key=value`` overrides as the pipeline's ``PIPELINE__SECTION__KEY`` environment."""
    env = dict(base)
    for item in overrides:
        key, _, value = item.partition("=")
        env["PIPELINE__" + "__".join(part.upper() for part in key.split("."))] = value
    return env


def pipeline(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)


def run_arm(label: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    base = {**os.environ, "PIPELINE_PARAMS": args.params, "PIPELINE__REPORT__LIMIT": str(args.questions),
            "PIPELINE__REPORT__ROLE_LEVEL": "false", "PIPELINE__REPORT__PREDICTIONS": "society"}
    env = env_of(overrides, base)
    pipeline(env, "services", "down", "serving")
    t0 = time.perf_counter()
    pipeline(env, "services", "up", "serving")
    up = time.perf_counter() - t0
    pipeline(env, "report")
    society = read(TestReport, ROOT / "reports/test.json").society
    after = society.after
    assert after.failures and after.yes_no  # the report's society figures carry them
    log = (ROOT / ".services/vllm-base.log").read_text(errors="replace")
    hits = HIT.findall(log)
    row = {"arm": label, "overrides": overrides, "up_s": up, "seconds": society.cost.seconds,
           "questions": society.questions, "failed": after.failures.n, "yes_no": after.yes_no.accuracy,
           "reward": after.reward.mean, "tokens": after.mean("tokens"), "prefix_hit_pct": float(hits[-1]) if hits else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/learn.yaml")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--arm", action="append", required=True, metavar="LABEL:key=value[,key=value]",
                    help="an arm: its label and the params it overrides (dotted keys)")
    ap.add_argument("--rounds", type=int, default=2, help="each arm this often, arms alternated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = [(spec.partition(":")[0], [o for o in spec.partition(":")[2].split(",") if o]) for spec in args.arm]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as kept:  # the checkout's own report comes back afterwards
        saved = [name for name in REPORTS if (ROOT / name).exists()]
        for name in saved:
            _copy(ROOT / name, Path(kept, name))
        try:
            for _ in range(args.rounds):
                rows += [run_arm(label, overrides, args) for label, overrides in arms]
        finally:
            pipeline({**os.environ, "PIPELINE_PARAMS": args.params}, "services", "down", "serving")
            for name in saved:
                _copy(Path(kept, name), ROOT / name)
    first = arms[0][0]
    ref = statistics.median(r["seconds"] for r in rows if r["arm"] == first)
    lines = ["# The report's society under serving settings, paired (`bench_society_arms.py`)", "",
             f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs: "
             f"`{args.params}`, the first {args.questions} test questions, the society as `make learn`'s report runs it "
             f"(live routing, the judge scoring), arms alternated {args.rounds} times, each after a restart of serving.",
             "", "| arm | overrides | societies s (each run) | median | vs " + first + " | tokens a society | failed | "
             "yes/no | mean reward | prefix-cache hits |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, overrides in arms:
        mine = [r for r in rows if r["arm"] == label]
        med = statistics.median(r["seconds"] for r in mine)
        hit = "/".join(f"{r['prefix_hit_pct']:.1f}%" for r in mine if r["prefix_hit_pct"] is not None)
        each = ", ".join(f"{r['seconds']:.0f}" for r in mine)
        named = ", ".join(f"`{o}`" for o in overrides)
        failed = "/".join(str(r["failed"]) for r in mine)
        lines.append(f"| {label} | {named} | {each} | {med:.0f} | **{med / ref:.2f}x** | "
                     f"{statistics.fmean(r['tokens'] for r in mine):.0f} | {failed} of {mine[0]['questions']} | "
                     f"{statistics.fmean(r['yes_no'] for r in mine):.3f} | {statistics.fmean(r['reward'] for r in mine):.3f} | "
                     f"{hit} |")
    if args.out:
        publish(args.out, lines, {"params": args.params, "questions": args.questions, "rounds": args.rounds, "runs": rows})
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
