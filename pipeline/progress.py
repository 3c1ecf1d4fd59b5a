"""Progress of long work where people watch it: rich's live bars on a terminal, plain lines in a log.

A rich bar draws nothing until it ends when stdout is not a terminal (an Airflow task log, DVC's or ``make learn``'s
output sent to a file): the report's 20-minute society pass printed one line, at 100 %. In a log each bar prints a
line at its first step, at every tenth of its work, and on the next step after a minute without one, with the time
spent and, from the second finished step on, the time left at the pace between finished steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich import get_console
from rich.progress import Progress

QUIET_S = 60.0  # in a log, the longest a bar that keeps advancing stays silent


class Bar:
    """One piece of work: ``update`` sets its total or the part already done, ``advance`` counts one step."""

    def __init__(self, description: str, total: int | None, live: tuple[Progress, Any] | None) -> None:
        self.description, self.total, self.done, self.live = description, total, 0, live
        self.t0 = self.said_at = time.monotonic()
        self.base, self.said_tenth = 0, -1  # base: done before this process began (a resumed shard), not its speed
        self.first_at: float | None = None  # when this process finished its first step

    def update(self, total: int | None = None, completed: int | None = None) -> None:
        if self.live is not None:
            self.live[0].update(self.live[1], total=total, completed=completed)
            return
        self.total = total if total is not None else self.total
        if completed is not None:
            self.done = self.base = completed
        self._say(first=True)

    def advance(self) -> None:
        if self.live is not None:
            self.live[0].advance(self.live[1])
            return
        self.done += 1
        self.first_at = self.first_at or time.monotonic()
        self._say()

    def _say(self, first: bool = False) -> None:
        now = time.monotonic()
        tenth = 10 * self.done // self.total if self.total else -1
        if not (first or tenth > self.said_tenth or now - self.said_at >= QUIET_S):
            return
        self.said_tenth, self.said_at = max(tenth, self.said_tenth), now
        spent = now - self.t0
        if not self.total:
            print(f"{self.description}: {self.done} done, {spent:.0f} s", flush=True)
            return
        # the pace between finished steps: with n in flight the first ends after a whole step's time (read as one
        # step's share it said ~100x too long) and queued work starts late; one finished step gives no pace yet
        ran, left = self.done - self.base, ""
        if ran > 1 and self.done < self.total and self.first_at is not None:
            left = f", ~{(now - self.first_at) / (ran - 1) * (self.total - self.done):.0f} s left"
        print(f"{self.description}: {self.done}/{self.total} ({self.done / self.total:.0%}), {spent:.0f} s{left}",
              flush=True)


@contextmanager
def bars() -> Iterator[Callable[[str, int | None], Bar]]:
    """``new(description, total)`` makes a bar (total None: not known yet); live bars on a terminal, lines in a log."""
    if not get_console().is_terminal:
        yield lambda description, total: Bar(description, total, None)
        return
    with Progress(transient=False) as progress:
        yield lambda description, total: Bar(description, total, (progress, progress.add_task(description, total=total)))
