"""Where a cycle's wall time goes: fixed costs against the work.

Each stage process (control plane and model plane) appends what it spent on fixed costs — its own start-up and
imports, the tracking server, the serving plane, loading a model, the registry — to one JSON-lines file per pipeline
run, ``.runs/<run id>/timings.jsonl``, and the stage's whole wall time when it ends. ``benchmarks/bench_cycle.py``
sets them against each stage's work (steps, rollouts, questions). The standard library only: the model plane imports
this module too, and a record that cannot be written never fails a stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

STAGE_ENV = "PIPELINE_STAGE"  # set by the stage's run, read by the processes it starts (the model plane)
FILE = "timings.jsonl"


class Phase:
    """The fixed costs' names (the benchmark's columns)."""

    STARTUP = "startup"  # interpreter start and imports, up to the stage's run (or the model plane's training)
    TRACKING = "tracking"  # the MLflow server ensured, the experiment and parent run found
    SERVING = "serving"  # the serving plane ensured: workers, proxy, routing verified
    MODEL_LOAD = "model_load"  # weights and tokenizer into memory
    REGISTRY = "registry"  # versions registered, baselines ensured, artifacts logged
    STAGE = "stage"  # the stage's whole run (control plane), for the work = stage - fixed


def path() -> Path | None:
    """Beside the run's effective params (``pipeline/runs.py``): under the working directory, the project's root."""
    run = os.environ.get("PIPELINE_RUN_ID")
    return Path(".runs", run, FILE) if run else None


_spent = [0.0]  # seconds this process already recorded as fixed costs (what its start-up must not count again)


def record(phase: str, seconds: float, plane: str = "control") -> None:
    """Append one line; silent when no pipeline run is set (a unit test, an ad-hoc call) or the file is not writable.
    A line written before the stage's run named the stage carries its process id, which the later lines name."""
    target = path()
    if target is None:
        return
    if phase != Phase.STAGE:
        _spent[0] += seconds
    line = json.dumps({"stage": os.environ.get(STAGE_ENV), "phase": phase, "seconds": round(seconds, 3), "plane": plane,
                       "pid": os.getpid(), "at": round(time.time(), 3)})
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        # one short O_APPEND write per line: lines of processes running side by side do not interleave
        with open(target, "a") as f:
            f.write(line + "\n")


_open: list[str] = []  # the phase this process is in: a phase inside another (tracking inside serving) is the outer's


@contextlib.contextmanager
def phase(name: str, plane: str = "control") -> Iterator[None]:
    if _open:
        yield
        return
    _open.append(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _open.pop()
        record(name, time.perf_counter() - t0, plane)


def startup() -> float:
    """This process's start-up so far: its age less the fixed costs it already recorded (a stage that ensured the
    serving plane before opening its run)."""
    return max(0.0, since_process_start() - _spent[0])


def since_process_start() -> float:
    """Seconds since this process was started (Linux ``/proc``)."""
    try:
        stat = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        started = int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
