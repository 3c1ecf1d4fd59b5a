"""Reward of one sampled completion of a role's agent, for GRPO on CPU (TRL) where the society is not re-run.

value = ``validity`` x (1 schema-valid | 0.5 a JSON object that fails the schema
                       | 0.5 x the share of the schema's fields named in text that is not JSON)
      + ``judge``    x the judge's weighted score of the completion (through the proxy, as in rollouts)
      + ``alignment`` x (an answer that decides: ``PIDecision``) the decision credit against the task's label
                       (``decision_credit``: 1 right, 0 wrong, ``reward.maybe_credit`` on a maybe label).

The schema is the one the call was decoded under in the society (its trace records it): the same grammar samples the
completion (``pipeline/rl/guided.py``) and grades it here.

Text that is not a JSON object is not judged (the served policy decodes under the schema's guided
decoding, so such text can never reach the society); it keeps partial credit for the schema fields it
names, so unguided sampling from a small model still gives GRPO groups whose rewards differ; a judge that fails,
answers invalid JSON or exceeds ``ppo.reward.timeout_s`` scores ``judge.failure_score``. Every
result carries its reason; nothing here raises into the trainer.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeline.agents.llm import RoleClient
from pipeline.config import JudgeParams, PpoRewardParams, RewardParams
from pipeline.rewards.judge import alignment, decision_credit
from pipeline.rewards.judge import judge as run_judge
from pipeline.schemas import PIDecision, named

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def completion_text(completion: Any) -> str:
    """TRL hands conversational completions as message lists, standard ones as strings."""
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return str(completion or "")


def _fields_named(name: str, text: str) -> tuple[float, str]:
    schema = named(name)
    if schema is None:
        return 0.0, ""
    names = list(schema.model_fields)
    found = sum(f'"{n}"' in text for n in names)
    return 0.5 * found / len(names), f" ({found}/{len(names)} {schema.__name__} fields named)"


def parse(name: str, text: str) -> tuple[float, BaseModel | dict[str, Any] | None, str]:
    """(validity, parsed object or None, reason); a reason starting ``malformed`` means "not judged"."""
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end <= start:
        partial, fields = _fields_named(name, text)
        return partial, None, f"malformed: no JSON object in the completion{fields}"
    try:
        raw = json.loads(body[start : end + 1])
    except json.JSONDecodeError as exc:
        partial, fields = _fields_named(name, text)
        return partial, None, f"malformed: invalid JSON ({exc.msg} at char {exc.pos}){fields}"
    if not isinstance(raw, dict):
        return 0.0, None, "malformed: JSON is not an object"
    schema = named(name)
    if schema is None:
        return 0.5, raw, f"no schema named {name!r}"
    try:
        return 1.0, schema.model_validate(raw), f"valid {schema.__name__}"
    except ValidationError as exc:
        first = exc.errors()[0]
        return 0.5, raw, f"JSON but not a valid {schema.__name__}: {'.'.join(map(str, first['loc']))}: {first['msg']}"


async def score(client: RoleClient, ppo_reward: PpoRewardParams, judge: JudgeParams, reward: RewardParams, agent: str,
                schema: str, text: str, task: dict[str, Any]) -> dict[str, Any]:
    """One completion of ``agent``, decoded under ``schema`` (a class of pipeline/schemas.py by name), scored."""
    validity, obj, why = parse(schema, text)
    decides = schema == PIDecision.__name__
    out: dict[str, Any] = {"agent": agent, "validity": validity, "judge": None, "aligned": None, "reason": why}
    if obj is None:  # not JSON: never judged
        return {**out, "value": ppo_reward.validity * validity}
    data = obj.model_dump() if isinstance(obj, BaseModel) else obj
    state = ({"decision": data, "protocol": "(the PI's decision on the team's protocol)"} if decides
             else {"protocol": data})
    judged: float | None = None
    if ppo_reward.judge == 0:  # a gold-only reward (benchmarks/bench_before_after.py): no judge call for a zero weight
        judge_reason = "weight 0, not called"
    else:
        try:
            res = await asyncio.wait_for(run_judge(client, judge, reward, task, state, 1, []), ppo_reward.timeout_s)
            judged, judge_reason = float(res["components"]["judge"]), res["reason"]
        except TimeoutError:
            judged, judge_reason = judge.failure_score, f"judge timed out after {ppo_reward.timeout_s:g}s"
    value = ppo_reward.validity * validity + ppo_reward.judge * (judged or 0.0)
    out.update(judge=judged, reason=f"{why}; judge: {judge_reason}")
    if decides:
        decision = (data or {}).get("decision")
        out["aligned"] = alignment(decision, task.get("final_decision"))["aligned"]
        out["decision"] = decision_credit(decision, task.get("final_decision"), reward)
        value += ppo_reward.alignment * out["decision"]
    return {**out, "value": value}
