"""Features of a supervisor decision, shared by the datasets stage and the live bandit policy.

The same function turns (question, candidate hypotheses) into features when the training data is
built from traces and when the trained policy picks at rollout time, so the two can never drift.
Features stay small and cheap: which junior wrote the candidate, how much of the question it
addresses, how much evidence it cites, its length; the question's words are the context.
"""

from __future__ import annotations

import re
from typing import Any

_WORD = re.compile(r"[a-z][a-z0-9-]{2,}")
_STOP = frozenset(["the", "and", "for", "with", "that", "this", "are", "was", "were", "from", "have", "has", "not", "but", "can",
                   "its", "their", "our", "which", "what", "does", "did", "into", "than", "then", "there", "these", "those",
                   "such", "also", "been", "being", "who", "whom", "whose", "how", "why", "when", "where"])


def words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


def context_features(question: str) -> dict[str, Any]:
    """Shared (per decision) features: the question's content words and its length."""
    ws = words(question)
    return {"q_words": sorted(set(ws))[:40], "q_len": round(len(ws) / 20, 3)}


def action_features(question: str, candidate: dict[str, Any]) -> dict[str, Any]:
    """Per-candidate features: author role and text features of the hypothesis."""
    q = set(words(question))
    hyp = words(str(candidate.get("hypothesis", "")))
    body = set(hyp) | set(words(str(candidate.get("rationale", ""))))
    return {
        "author": str(candidate.get("author", "unknown")),
        "overlap": round(len(body & q) / max(1, len(q)), 3),
        "n_pmids": len(candidate.get("evidence_pmids") or []),
        "h_len": round(len(hyp) / 50, 3),
    }


def decision_features(question: str, candidates: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return context_features(question), [action_features(question, c) for c in candidates]
