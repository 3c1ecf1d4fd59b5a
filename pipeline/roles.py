"""The logical models the society's code calls by name: what a routing version maps to deployments.

``serving.roles`` in params.yaml lists the ones the proxy serves; the graph, the trace adapters, evaluation and the
RL agent name them here, so one spelling holds everywhere (tests/test_config.py checks each is served).
"""

from __future__ import annotations

JUNIOR = "junior_researcher"   # the three juniors' calls: open every rollout (from START)
SUPERVISOR = "supervisor"
SENIOR = "senior_researcher"   # refiner, designer and PI
REVIEW_BOARD = "review_board"  # peer reviewer and safety officer
JUDGE = "judge"

ALL = (JUNIOR, SUPERVISOR, SENIOR, REVIEW_BOARD, JUDGE)
