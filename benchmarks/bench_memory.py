"""Peak memory of every process a command starts: is `make run` / `make learn` within a laptop's memory?

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_memory.py [--interval 2] [--limit-gb 6] \
        [--out docs/benchmarks-memory.md] -- make learn

Runs the command and, every ``--interval`` seconds, reads the resident set size of it and every process it started
(psutil, the whole tree, including services such as the vLLM worker that outlive it), keeping each process's peak
and the peak of their sum. Prints and writes (markdown + JSON beside it) the processes ranked by peak RSS, the
command's wall time and exit status, and whether every process stayed under ``--limit-gb``. Sampling misses a peak
shorter than the interval; the kernel's own high-water mark (``VmHWM``) is read at each sample too, so a process
alive at a sample reports its true peak.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from report import write_report

from pipeline.io import write_json

GB = 1024**3


def _hwm(proc: psutil.Process) -> int:
    """The kernel's peak RSS of the process (VmHWM), or its current RSS where /proc does not say."""
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return int(proc.memory_info().rss)
    except (OSError, psutil.Error):
        return 0


def _label(proc: psutil.Process) -> str:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    text = " ".join(cmd)
    for marker in ("-m pipeline ", "vllm.entrypoints", "litellm", "mlflow", "VLLM::EngineCore", "dvc "):
        if marker in text:
            i = text.index(marker)
            return text[i:i + 80]
    return text[:80]


def measure(argv: list[str], interval: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    root = subprocess.Popen(argv)
    me = psutil.Process(root.pid)
    peaks: dict[int, dict[str, Any]] = {}
    total_peak = 0
    seen_children: set[int] = set()
    while root.poll() is None:
        try:
            tree = [me, *me.children(recursive=True)]
        except psutil.Error:
            tree = []
        # services the command started outlive it (they re-parent to init): keep sampling those it was seen starting
        tree += [p for pid in seen_children - {p.pid for p in tree} if psutil.pid_exists(pid) for p in [psutil.Process(pid)]]
        total = 0
        for proc in tree:
            seen_children.add(proc.pid)
            try:
                rss = int(proc.memory_info().rss)
            except psutil.Error:
                continue
            total += rss
            entry = peaks.setdefault(proc.pid, {"pid": proc.pid, "label": _label(proc), "peak_rss": 0})
            entry["peak_rss"] = max(entry["peak_rss"], rss, _hwm(proc))
        total_peak = max(total_peak, total)
        time.sleep(interval)
    ranked = sorted(peaks.values(), key=lambda e: -e["peak_rss"])
    return {"command": argv, "returncode": root.returncode, "wall_s": time.perf_counter() - t0, "interval_s": interval,
            "processes": len(ranked), "sum_peak_gb": total_peak / GB,
            "top": [{**e, "peak_gb": e["peak_rss"] / GB} for e in ranked[:15]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--limit-gb", type=float, default=6.0)
    ap.add_argument("--out", default="docs/benchmarks-memory.md")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = [a for a in args.command if a != "--"]
    if not argv:
        ap.error("a command to measure, after --")
    result = measure(argv, args.interval)
    worst = result["top"][0]["peak_gb"] if result["top"] else 0.0
    result.update(limit_gb=args.limit_gb, within_limit=worst <= args.limit_gb,
                  date=datetime.now(UTC).isoformat(timespec="seconds"))
    lines = [f"# Peak memory: `{' '.join(argv)}`", "",
             f"Measured {result['date']} on this host by `benchmarks/bench_memory.py` (RSS of every process the command "
             f"started, sampled every {args.interval:g} s, with each process's kernel high-water mark).", "",
             f"- exit status {result['returncode']}, wall time {result['wall_s'] / 60:.1f} min, {result['processes']} processes",
             f"- largest process: **{worst:.2f} GB** "
             f"(limit {args.limit_gb:g} GB: {'within' if result['within_limit'] else 'OVER'})",
             f"- largest sum over all processes at one sample: {result['sum_peak_gb']:.2f} GB", "",
             "| process | pid | peak RSS (GB) |", "|---|---|---|",
             *(f"| `{e['label']}` | {e['pid']} | {e['peak_gb']:.2f} |" for e in result["top"]), ""]
    print("\n".join(lines))
    write_report(args.out, lines)
    write_json(Path(args.out).with_suffix(".json"), result)
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
