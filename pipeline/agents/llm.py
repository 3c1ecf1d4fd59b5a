"""Role-aware chat client over the OpenAI-compatible proxy, recording every call as an llm span.

Agents know only (base_url, key) and their logical model name. Structured outputs are requested
with the schema's ``response_format`` and validated; an invalid answer is fed back with the
validation error for a bounded number of repairs, then recorded as a failure (never raised).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import time
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from pydantic import ValidationError

from pipeline.agents.prompts import REPOSITORY, Prompts
from pipeline.agents.replay import CallBook, request_key
from pipeline.digest import served_digest
from pipeline.schemas import StructuredOutput

if TYPE_CHECKING:
    from typing import Self

    from pipeline.config import AgentsParams

T = TypeVar("T", bound=StructuredOutput)

DESIGNER_TOKENS = 4  # the protocol designer's cap, in agents.max_tokens: a protocol is the society's longest answer


def senior_completion_ceiling(agents: AgentsParams) -> int:
    """The most completion tokens a senior_researcher call may ask for (the designer's cap, or a schema budget
    raised up to ``token_ceiling``): what an RL trainer's response length must cover, or it trains on cut answers."""
    return max(DESIGNER_TOKENS * agents.max_tokens, agents.token_ceiling)


class LLMError(RuntimeError):
    pass


# The sampling seed of the rollout running in this asyncio task (set by ``agents.rollout``): every call's
# ``seed`` is derived from it, the agent and the exact messages, so two societies that send the same call
# in the same rollout (a champion and a candidate evaluated on the same task) draw the same random numbers,
# and a difference between them comes from the model that differs, not from the dice (common random numbers).
ROLLOUT_SEED: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_seed", default=None)


def call_seed(agent: str, messages: list[dict[str, str]]) -> int | None:
    base = ROLLOUT_SEED.get()
    if base is None:
        return None
    digest = hashlib.sha256(f"{base}\0{agent}\0{json.dumps(messages, sort_keys=True)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _float(value: str | None) -> float | None:
    """A numeric response header (LiteLLM's own per-request overhead), None when absent or "None"."""
    try:
        return float(value) if value else None
    except ValueError:
        return None


class RoleClient:
    def __init__(self, base_url: str, api_key: str, max_tokens: int = 256, temperature: float = 0.7,
                 json_retries: int = 2, timeout_s: float = 300.0, routing: str | None = None, token_ceiling: int = 768,
                 frequency_penalty: float = 0.0, replay: CallBook | None = None, unavailable_wait_s: float = 0.0,
                 prompts: Prompts = REPOSITORY, transport_retries: int = 2, transport_backoff_s: float = 2.0,
                 text_scale: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.prompts = prompts  # what this society renders: the routed versions of its templates (prompt_registry.sync)
        self.replay = replay  # recorded calls of roles not under evaluation, answered from the record (agents.replay)
        self.routing = routing  # an evaluation routing table the proxy should route these calls by (None = the live one)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.json_retries = json_retries
        self.token_ceiling = token_ceiling
        self.frequency_penalty = frequency_penalty
        self.unavailable_wait_s = unavailable_wait_s
        self.transport_retries = transport_retries
        self.transport_backoff_s = transport_backoff_s
        self.text_scale = text_scale  # of every structured answer's string lengths (agents.text_scale)
        self._http = httpx.AsyncClient(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})

    @classmethod
    def for_agents(cls, agents: AgentsParams, base_url: str, api_key: str, timeout_s: float, *, max_tokens: int | None = None,
                   routing: str | None = None, **kwargs: Any) -> Self:
        """A client sized by ``params.agents`` (every stage that runs the society or its judge builds one)."""
        return cls(base_url, api_key, max_tokens or agents.max_tokens, agents.temperature, agents.json_retries, timeout_s,
                   routing=routing, token_ceiling=agents.token_ceiling, frequency_penalty=agents.frequency_penalty,
                   unavailable_wait_s=agents.unavailable_wait_s, transport_retries=agents.transport_retries,
                   transport_backoff_s=agents.transport_backoff_s, text_scale=agents.text_scale, **kwargs)

    def endpoint(self, model: str) -> tuple[str, dict[str, str] | None]:
        """(base URL, extra headers) a call for ``model`` goes to: the proxy for every role here; the RL
        entry point overrides it to send the roles being trained through the Agent Lightning gateway."""
        return self.base_url, None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(self, agent: str, model: str, messages: list[dict[str, str]], spans: list[dict[str, Any]],
                   response_format: dict[str, Any] | None = None, max_tokens: int | None = None,
                   frequency_penalty: float | None = None, temperature: float | None = None,
                   top_logprobs: int | None = None, prompt: str | None = None, continue_from: str | None = None,
                   stop: list[str] | None = None) -> str:
        """One call; ``frequency_penalty`` and ``temperature`` override the client's for this call (the judge
        samples with its own); ``top_logprobs`` asks for each generated token's alternatives (span ``logprobs``);
        ``continue_from``: the assistant's answer so far, which the model continues (vLLM's continue_final_message)."""
        penalty = self.frequency_penalty if frequency_penalty is None else frequency_penalty
        temp = self.temperature if temperature is None else temperature
        if continue_from is not None:
            messages = [*messages, {"role": "assistant", "content": continue_from}]
        body: dict[str, Any] = {"model": model, "messages": messages, "temperature": temp,
                                "max_tokens": max_tokens or self.max_tokens}
        if continue_from is not None:
            body.update(continue_final_message=True, add_generation_prompt=False)
        if stop:
            body["stop"] = stop
        if penalty:
            body["frequency_penalty"] = penalty
        if (seed := call_seed(agent, messages)) is not None:
            body["seed"] = seed
        if top_logprobs:
            body.update(logprobs=True, top_logprobs=top_logprobs)
        if response_format:
            body["response_format"] = response_format
        if self.routing:
            body["metadata"] = {"routing": self.routing}
        # the request as sent (messages, caps, schema name below): benchmarks/bench_rollouts.py replays traces from these
        span: dict[str, Any] = {"kind": "llm", "name": agent,
                                "data": {"agent": agent, "logical_model": model, "messages": messages,
                                         "max_tokens": body["max_tokens"], "temperature": temp,
                                         "frequency_penalty": penalty, "seed": body.get("seed")}}
        if prompt is not None:  # the template the request was rendered from, and its version
            span["data"].update(prompt=prompt, prompt_sha=self.prompts.sha(prompt), prompt_version=self.prompts.version(prompt))
        span["data"]["request_key"] = key = request_key(agent, body)
        # a call that asks for logprobs (the judge's) runs live: a record keeps no logprobs (they are taken off the span),
        # so a replayed answer would score as if the judge had given no probabilities at all
        claim = None
        if self.replay is not None and not top_logprobs:
            recorded, claim = await self.replay.draw(model, key)
            if recorded is not None:
                span["data"].update(ok=True, replayed=True, latency_s=0.0, **recorded)
                spans.append(span)
                return recorded["output"] or ""
        try:
            return await self._send(agent, model, body, span, spans, bool(top_logprobs))
        finally:
            if claim is not None:  # the draw others sharing this book wait for (replay.CallBook.sharing)
                claim.settle(span["data"])

    async def _send(self, agent: str, model: str, body: dict[str, Any], span: dict[str, Any], spans: list[dict[str, Any]],
                    logprobs: bool) -> str:
        """The request sent to the model; its answer (or failure) recorded on ``span``, which joins ``spans``."""
        t0 = time.perf_counter()
        base_url, headers = self.endpoint(model)
        try:
            resp = await self._post(f"{base_url}/chat/completions", body, headers)
        except httpx.HTTPError as exc:
            span["data"].update(ok=False, error=f"{type(exc).__name__}: {exc}", latency_s=time.perf_counter() - t0)
            spans.append(span)
            raise LLMError(f"{agent}: {type(exc).__name__}: {exc}") from exc
        latency = time.perf_counter() - t0
        if resp.status_code != 200:
            span["data"].update(ok=False, error=f"HTTP {resp.status_code}: {resp.text[:300]}", latency_s=latency)
            spans.append(span)
            raise LLMError(f"{agent}: HTTP {resp.status_code}: {resp.text[:200]}")
        payload = resp.json()
        output = payload["choices"][0]["message"].get("content") or ""
        span["data"].update(ok=True, output=output, usage=payload.get("usage", {}), latency_s=latency,
                            finish_reason=payload["choices"][0].get("finish_reason"),
                            served_model=resp.headers.get("x-litellm-model-name", payload.get("model")),
                            deployment=resp.headers.get("x-litellm-model-group"),
                            # the weights that answered: a LoRA deployment's name carries its verified sha256 prefix
                            digest=served_digest(resp.headers.get("x-litellm-model-group")),
                            proxy_overhead_ms=_float(resp.headers.get("x-litellm-overhead-duration-ms")))
        if logprobs:  # taken off the span by whoever asked (pipeline.rewards.judge), so traces stay small
            span["data"]["logprobs"] = (payload["choices"][0].get("logprobs") or {}).get("content") or []
        spans.append(span)
        return output

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None) -> httpx.Response:
        """The request, again after each 503 (a deployment down or restarting) for at most ``unavailable_wait_s``, and
        after a dropped connection ``transport_retries`` times (waits doubling from ``transport_backoff_s``)."""
        deadline = time.monotonic() + self.unavailable_wait_s
        failures = 0
        while True:
            try:
                resp = await self._http.post(url, json=body, headers=headers)
            except httpx.TransportError:  # a dropped connection is retried a bounded number of times, then raised
                failures += 1
                if failures > self.transport_retries:
                    raise
                await asyncio.sleep(self.transport_backoff_s * 2 ** (failures - 1))
                continue
            left = deadline - time.monotonic()
            if resp.status_code != 503 or left <= 0:
                return resp
            try:
                wait = float(resp.headers.get("retry-after", "5"))
            except ValueError:
                wait = 5.0
            await asyncio.sleep(max(0.5, min(wait, left)))

    async def structured(self, agent: str, model: str, messages: list[dict[str, str]], schema: type[T],
                         spans: list[dict[str, Any]], max_tokens: int | None = None, frequency_penalty: float | None = None,
                         temperature: float | None = None, top_logprobs: int | None = None,
                         prompt: str | None = None) -> T | None:
        """Validated object, or None after ``json_retries`` repairs (each attempt is a span).

        The cap is raised to the schema's token budget (at most ``token_ceiling``, which keeps prompt +
        completion inside the worker's context): a cap below it truncates a valid answer into invalid JSON."""
        history, grammar = list(messages), schema.response_format(self.text_scale)
        cap = max(max_tokens or self.max_tokens, min(schema.token_budget(self.text_scale), self.token_ceiling))
        for attempt in range(self.json_retries + 1):
            text = await self.chat(agent, model, history, spans, grammar, cap, frequency_penalty, temperature, top_logprobs,
                                   prompt)
            call = spans[-1]["data"]  # the llm span chat() just recorded: the datasets stage reads these two fields
            call.update(attempt=attempt + 1, parsed=False, schema=schema.__name__)
            try:
                obj = schema.model_validate_json(text)
                call["parsed"] = True
            except ValidationError as exc:
                problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
                spans.append({"kind": "reward", "name": f"{agent}.valid_output", "data": {
                    "value": 0.0, "kind": "intermediate",
                    "reason": f"attempt {attempt + 1}: invalid {schema.__name__}: {problem}"}})
                history = [*messages, {"role": "assistant", "content": text[:1500]},
                           {"role": "user", "content": f"That was not valid {schema.__name__} JSON ({problem}). "
                                                       "Answer again with valid JSON only."}]
                continue
            spans.append({"kind": "reward", "name": f"{agent}.valid_output", "data": {
                "value": 1.0, "kind": "intermediate", "reason": f"valid {schema.__name__} on attempt {attempt + 1}"}})
            return obj
        return None
