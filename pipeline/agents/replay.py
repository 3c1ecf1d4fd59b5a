"""Replay a recorded society's LLM calls for the roles a candidate does not change (common random numbers).

A candidate for role R changes only R's calls and whatever follows from their answers. Evaluated whole,
its society also re-samples every other role's calls, and the paired difference with the champion then
carries both societies' sampling noise on top of R's effect (unless ``agents.seeded_calls`` gives both the
same dice; replay also saves the calls' cost). Replayed, every call of another role whose request is *exactly* the one
the champion's society sent on the same task (same agent, logical model, messages, caps, temperature and
response format) gets the champion's recorded answer instead of a new sample. So the two societies share
everything up to R's first call, R's answers are the only new randomness, and the calls before R cost
nothing. After R has answered differently, the prompts differ and the calls run live; a request that
happens to be identical is still the champion's (same role, same model, same input).

R's own calls are never replayed (``live`` names their logical models): they are sent to the candidate's model.
With seeded calls an identical candidate then answers as the champion did, and any difference is the candidate's.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

# The rollout the running asyncio task belongs to (set by ``agents.rollout.run_rollout``): a recorded call
# is replayed only into a rollout of the same id (same task, same exploration seed).
ROLLOUT_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_id", default=None)

# what a replayed span copies from the recorded one (the request itself is equal by construction)
_ANSWER = ("output", "usage", "finish_reason", "served_model", "deployment", "digest")


def request_key(agent: str, body: dict[str, Any]) -> str:
    """The identity of one chat request: two requests with equal keys are the same draw from the same model."""
    fields = {k: body.get(k) for k in ("model", "messages", "max_tokens", "temperature", "frequency_penalty", "seed",
                                       "response_format", "logprobs", "top_logprobs")}
    return hashlib.sha256(json.dumps([agent, fields], sort_keys=True, default=str).encode()).hexdigest()


class CallBook:
    """The successful LLM calls of recorded traces, by rollout id and request key; each recorded call is used once
    per attempt: a retried rollout (``rewind``) is answered from the start of the record again."""

    def __init__(self, live: Iterable[str] = ()) -> None:
        self.live = frozenset(live)  # logical models whose calls always run (the candidate's role)
        self._calls: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        self._used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # this attempt's answers taken
        self.replayed = 0
        self.missed = 0

    @classmethod
    def from_traces(cls, traces: Iterable[Any], live: Iterable[str] = ()) -> CallBook:
        """From ``Trace`` objects (or their dicts); only calls that answered (``ok``) and recorded their request key."""
        book = cls(live)
        for trace in traces:
            book.add(trace)
        return book

    def add(self, trace: Any) -> None:
        """Record one more trace: evaluate fills a candidate's book task by task, as the champion's rollouts finish."""
        t = trace if isinstance(trace, dict) else trace.model_dump()
        for span in t.get("spans", []):
            d = span.get("data", {})
            if span.get("kind") == "llm" and d.get("ok") and d.get("request_key"):
                self._calls[t["rollout_id"]][d["request_key"]].append(d)

    def __len__(self) -> int:
        return sum(len(calls) for by_key in self._calls.values() for calls in by_key.values())

    def take(self, model: str, key: str) -> dict[str, Any] | None:
        """The recorded answer to this request in the current rollout, or None (run it live)."""
        if model in self.live:
            return None
        rollout = ROLLOUT_ID.get() or ""
        calls = self._calls.get(rollout, {}).get(key, [])
        used = self._used[rollout][key]
        if used >= len(calls):
            self.missed += 1
            return None
        self.replayed += 1
        self._used[rollout][key] = used + 1
        recorded = calls[used]
        return {k: recorded.get(k) for k in _ANSWER}

    def rewind(self, rollout_id: str) -> None:
        """A new attempt at ``rollout_id``: its recorded calls answer again (a failed attempt must not use them up)."""
        self._used.pop(rollout_id, None)
