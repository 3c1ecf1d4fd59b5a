"""The logical models the society's code calls by name: what a routing version maps to deployments.

``serving.roles`` in params.yaml lists the ones the proxy serves; the graph, the trace adapters, evaluation and the
RL agent name them here, so one spelling holds everywhere (tests/test_config.py checks each is served).
"""

from __future__ import annotations

JUNIOR = "junior_researcher"   # the three juniors' calls: open every rollout (from START)
SUPERVISOR = "supervisor"
SENIOR = "senior_researcher"   # refiner and designer
PI = "principal_investigator"  # the GO/NO-GO: the one output a PubMedQA label checks
REVIEW_BOARD = "review_board"  # peer reviewer and safety officer
JUDGE = "judge"

ALL = (JUNIOR, SUPERVISOR, SENIOR, PI, REVIEW_BOARD, JUDGE)

# A routing version written before a role had its own logical model routes it where its calls went then:
# the PI's calls were the senior researcher's until the PI got a policy of its own (docs/serving.md, migration).
FALLBACK = {PI: SENIOR}
