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

Societies that run side by side share one book (:meth:`CallBook.sharing`): a call is answered by whichever society
sent that request first, while it is still in flight (a draw shared, never sent twice), so a candidate runs each task
beside the champion's rollout of it instead of after it, and the engine decodes both at once. Every society of one book
routes the roles outside its ``live`` set to the same deployments (a candidate's table differs only in its role), so
the same request is the same draw whoever sends it.
"""

from __future__ import annotations

import asyncio
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
    """One society's view of the recorded and in-flight LLM calls, by rollout id and request key. A request's n-th
    occurrence in a rollout is answered by the n-th recorded draw of that request, awaited while it is in flight; each
    is used once per attempt: a retried rollout (``rewind``) is answered from the start of the record again."""

    def __init__(self, live: Iterable[str] = (), shared: CallBook | None = None) -> None:
        self.live = frozenset(live)  # logical models whose calls always run (the candidate's role)
        # rollout id -> request key -> draws in order: an answer, or a future while the call that draws it runs
        self._calls: dict[str, dict[str, list[Any]]] = (defaultdict(lambda: defaultdict(list)) if shared is None
                                                        else shared._calls)
        self._used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # this attempt's answers taken
        self.replayed = 0

    @classmethod
    def from_traces(cls, traces: Iterable[Any], live: Iterable[str] = ()) -> CallBook:
        """From ``Trace`` objects (or their dicts); only calls that answered (``ok``) and recorded their request key."""
        book = cls(live)
        for trace in traces:
            t = trace if isinstance(trace, dict) else trace.model_dump()
            for span in t.get("spans", []):
                d = span.get("data", {})
                if span.get("kind") == "llm" and d.get("ok") and d.get("request_key"):
                    book._calls[t["rollout_id"]][d["request_key"]].append(_answer(d))
        return book

    def sharing(self, live: Iterable[str] = ()) -> CallBook:
        """Another society's view of the same draws, ``live`` its own role's logical models."""
        return CallBook(live, shared=self)

    async def draw(self, model: str, key: str) -> tuple[dict[str, Any] | None, Claim | None]:
        """(the recorded answer to this request in the current rollout, None) or, when nobody has drawn it yet,
        (None, a claim): the caller sends it and settles the claim; whoever asks it meanwhile waits for that draw.
        (None, None): ``model`` is live here, or the draw it would have shared failed: sent, not shared."""
        if model in self.live:
            return None, None
        rollout = ROLLOUT_ID.get() or ""
        draws, n = self._calls[rollout][key], self._used[rollout][key]
        self._used[rollout][key] = n + 1
        if n == len(draws):
            claim = Claim(draws, n)
            draws.append(claim.future)
            return None, claim
        found = draws[n]
        if isinstance(found, asyncio.Future):
            found = await asyncio.shield(found)
        if found is None:
            return None, None
        self.replayed += 1
        return found, None

    def rewind(self, rollout_id: str) -> None:
        """A new attempt at ``rollout_id``: its recorded calls answer again (a failed attempt must not use them up)."""
        self._used.pop(rollout_id, None)


class Claim:
    """A draw being made: its place in the book and the future the others wait on."""

    def __init__(self, draws: list[Any], index: int) -> None:
        self.draws, self.index = draws, index
        self.future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()

    def settle(self, data: dict[str, Any]) -> None:
        """The call ended: its answer (``data``, the span's, when ``ok``) is the draw, else None (failed, cancelled:
        whoever waited sends the request itself)."""
        answer = _answer(data) if data.get("ok") else None
        self.draws[self.index] = answer
        if not self.future.done():
            self.future.set_result(answer)


def _answer(data: dict[str, Any]) -> dict[str, Any]:
    """What a replayed span copies from the span that drew it (the request itself is equal by construction)."""
    return {k: data.get(k) for k in _ANSWER}
