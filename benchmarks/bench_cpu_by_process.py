"""Where a command's CPU goes, by process: the vLLM workers' forward passes against the control plane's servers,
the CLI processes and the test process itself (#54: which fixed cost to cut next is read from this, not guessed).

``run -- CMD ...`` runs CMD and, beside it, samples the cumulative CPU (``/proc/<pid>/stat`` utime + stime) of
every process on the host every ``--every`` seconds (the services a command starts are not its children: run it
with nothing else running); ``sample OUT`` only samples (until SIGTERM), for a command started elsewhere;
``report SAMPLES`` renders a samples file. A process started after the sampler counts from zero; one that starts and
ends between two samples is missed (the table's total says how much CPU it saw against the host's core-seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
# (substring of the command line or process name, the class it is reported under), first match wins
CLASSES = [("VLLM::Worker", "vLLM worker (forward passes)"),
           ("VLLM::EngineCore", "vLLM engine core (scheduler; with inline_model the forward passes too)"),
           ("vllm.entrypoints", "vLLM API server"), ("pipeline.serving.vllm_cpu", "vLLM API server"),  # the CPU workers'
           ("multiprocessing.spawn", "vLLM worker / engine core (before its title)"),
           ("litellm", "LiteLLM proxy"), ("mlflow.server", "MLflow server"), ("uvicorn", "MLflow server"),
           ("mlflow server", "MLflow server (launcher)"), ("-m pytest", "pytest (tests and in-process CLI calls)"),
           ("--in-model-plane", "model-plane stage (trainers, materialize)"), ("-m pipeline", "pipeline CLI process"),
           ("airflow", "Airflow"), ("dvc", "DVC"), ("postgres", "Postgres"), ("redis", "Redis")]


def _cmdline(pid: str) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]


class Sampler:
    """Cumulative CPU seconds per pid: [at first sight (0 if it started after the sampler), last, command, name]."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.t0 = float(Path("/proc/uptime").read_text().split()[0])
        self.seen: dict[str, list] = {}

    def snap(self) -> None:
        for pid in (d for d in os.listdir("/proc") if d.isdigit()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                rest = stat[stat.rindex(")") + 2:].split()
                cpu = (int(rest[11]) + int(rest[12])) / self.tick
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                if pid in self.seen:
                    self.seen[pid][1] = cpu
                    # an exec (run_tests.sh's pytest) or a title set after start (vLLM's children) renames a process
                    if name != self.seen[pid][3] or "multiprocessing.spawn" in self.seen[pid][2]:
                        self.seen[pid][2:] = [_cmdline(pid) or name, name]
                    continue
                cmd = _cmdline(pid)
                started = int(rest[19]) / self.tick
                self.seen[pid] = [0.0 if started > self.t0 else cpu, cpu, cmd or name, name]
            except (OSError, ValueError, IndexError):  # gone between listdir and read
                pass


def classify(cmd: str, name: str) -> str:
    return next((label for pat, label in CLASSES if pat in cmd or pat in name), f"other: {name}")


def table(samples: dict[str, list], wall_s: float, cores: int) -> list[str]:
    by = Counter[str]()
    for first, last, cmd, name in samples.values():
        by[classify(cmd, name)] += last - first
    total = sum(by.values())
    rows = [f"| {label} | {s:,.0f} | {100 * s / total:.1f} % |" for label, s in by.most_common() if s >= 1]
    return ["| process | CPU s | share |", "| --- | --- | --- |", *rows,
            f"| **all** | **{total:,.0f}** | {100 * total / (wall_s * cores):.0f} % of the host's {wall_s * cores:,.0f} "
            f"core-seconds ({cores} cores x {wall_s:,.0f} s) |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--every", type=float, default=2.0)
    r.add_argument("--name", default="cpu-by-process", help="docs/benchmarks-<name>.md and .json")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    s = sub.add_parser("sample")
    s.add_argument("out")
    s.add_argument("--every", type=float, default=2.0)
    p = sub.add_parser("report")
    p.add_argument("samples")
    p.add_argument("--wall-s", type=float, required=True)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.mode == "report":
        print("\n".join(table(json.loads(Path(args.samples).read_text()), args.wall_s, cores)))
        return
    sampler, done = Sampler(), threading.Event()
    if args.mode == "sample":
        def stop(*_: object) -> None:
            Path(args.out).write_text(json.dumps(sampler.seen))
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        while True:
            sampler.snap()
            time.sleep(args.every)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd

    def loop() -> None:
        while not done.is_set():
            sampler.snap()
            done.wait(args.every)

    thread = threading.Thread(target=loop, daemon=True)
    start = time.monotonic()
    thread.start()
    code = subprocess.call(cmd)
    done.set()
    thread.join()
    sampler.snap()
    wall = time.monotonic() - start
    lines = [f"# CPU by process: `{' '.join(cmd)}`", "", f"`benchmarks/bench_cpu_by_process.py`, exit {code}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, sampled every {args.every:g} s.", "",
             *table(sampler.seen, wall, cores), ""]
    (DOCS / f"benchmarks-{args.name}.md").write_text("\n".join(lines))
    record = {"cmd": cmd, "exit": code, "wall_s": wall, "samples": sampler.seen}
    (DOCS / f"benchmarks-{args.name}.json").write_text(json.dumps(record))
    print("\n".join(lines))
    sys.exit(code)


if __name__ == "__main__":
    main()
