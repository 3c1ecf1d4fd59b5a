"""Long work in a log (an Airflow task, `make learn > file`): a line at its first step and at each tenth, with the time left."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

WORK = textwrap.dedent("""
    import time
    from pipeline.progress import bars
    with bars() as new:
        society, shard = new("report: the society on the test split", 20), new("rollouts shard 0", None)
        shard.update(total=4, completed=1)  # a resumed shard: one rollout already journalled
        for _ in range(20):
            society.advance()
        for _ in range(3):
            shard.advance()
        queued = new("evaluate: societies: eval-candidate", 4)  # behind another society's queue
        time.sleep(2)
        queued.advance()
        queued.advance()
""")


def test_a_log_shows_each_tenth_of_the_work_while_it_runs() -> None:
    out = subprocess.run([sys.executable, "-c", WORK], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.splitlines()
    society = [line for line in lines if line.startswith("report: the society")]
    assert [line.split(": ", 2)[2].split(" ")[0] for line in society] == ["1/20"] + [f"{2 * k}/20" for k in range(1, 11)], lines
    # one finished step gives no pace; the last says it is done, not what is left
    assert "s left" not in society[0] and "s left" in society[1] and "s left" not in society[-1], society
    shard = [line for line in lines if line.startswith("rollouts shard 0")]
    assert shard[0].startswith("rollouts shard 0: 1/4 (25%)") and shard[-1].startswith("rollouts shard 0: 4/4 (100%)"), shard


def test_a_bar_queued_behind_other_work_tells_the_time_left_from_its_own_pace() -> None:
    """The report's replayed society waits for the champion's (and a step among 32 in flight ends after a whole step's
    time): the time left is read from the pace between finished steps, not from the wait before the first."""
    out = subprocess.run([sys.executable, "-c", WORK], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    queued = [line for line in out.stdout.splitlines() if line.startswith("evaluate: societies: eval-candidate")]
    # the 2 s queued count as time spent (more when the host holds this process off its core), not as pace
    spent = re.match(r"evaluate: societies: eval-candidate: 2/4 \(50%\), (\d+) s, ~0 s left", queued[1])
    assert spent and int(spent[1]) >= 2, queued
