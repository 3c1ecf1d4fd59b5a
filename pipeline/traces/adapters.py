"""Trace -> training data adapters: the one place that knows how traces become datasets.

Three views of the same rollouts:

- **SFT** (``junior_researcher``): every call a junior made (ReAct tool step or hypothesis), as the
  exact message list it sent and the output it produced, from rollouts that rank in the top
  ``top_k`` of their task group and reach ``min_reward``; only outputs that parsed on the first
  attempt (a repaired answer was shown its own mistake, which the served model never is). Each carries the same call
  of the group's worst rollout, for the trainer's held-out check.
- **RL prompts** (each role of ``ppo.roles``): the first-attempt message lists its trained agents received, with the
  schema the answer was decoded under, task id, label and abstract, for GRPO (TRL) and verl.
- **Bandit** (``supervisor``): one logged decision per rollout: context and candidate features,
  the chosen index, its logged propensity and the logging distribution, and the final reward.

Bad lines never stop the adapters: each dropped line, rollout or call is counted under a reason
(``Drops``) and a few examples naming file and line are kept for the report.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.bandit.features import decision_features
from pipeline.config import DatasetsParams
from pipeline.traces.schema import Trace


@dataclass
class Drops:
    """Per-reason counts of what an adapter skipped, with a few located examples."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < 3:
            self.examples[reason].append(where)


def read_traces(paths: Iterable[Path], drops: Drops) -> list[Trace]:
    """Every valid trace line; a truncated, invalid or undecodable line is counted, not fatal."""
    traces: list[Trace] = []
    for path in paths:
        for n, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                traces.append(Trace.model_validate(json.loads(line)))
            except UnicodeDecodeError as exc:
                drops.add("not_utf8", f"{path}:{n}: byte {exc.start}: {exc.reason}")
            except json.JSONDecodeError as exc:
                drops.add("truncated_line", f"{path}:{n}: {exc.msg}")
            except RecursionError:
                drops.add("invalid_trace", f"{path}:{n}: JSON nested too deeply")
            except ValidationError as exc:
                first = exc.errors()[0]
                drops.add("invalid_trace", f"{path}:{n}: {'.'.join(map(str, first['loc']))}: {first['msg']}")
    return traces


def group_ranks(traces: list[Trace]) -> dict[str, int]:
    """rollout_id -> rank of its reward within its task group (0 = best; failed rollouts unranked)."""
    groups: dict[str, list[Trace]] = defaultdict(list)
    for t in traces:
        if t.status == "ok" and t.reward is not None:
            groups[t.task_id].append(t)
    ranks: dict[str, int] = {}
    for members in groups.values():
        for rank, t in enumerate(sorted(members, key=lambda t: (-(t.reward or 0.0), t.rollout_id))):
            ranks[t.rollout_id] = rank
    return ranks


def _llm_calls(trace: Trace, agents: set[str] | None = None, model: str | None = None) -> Iterable[dict[str, Any]]:
    for span in trace.spans:
        d = span.data
        if span.kind != "llm" or not d.get("ok"):
            continue
        if agents is not None and d.get("agent") not in agents:
            continue
        if model is not None and d.get("logical_model") != model:
            continue
        yield d


def sft_examples(traces: list[Trace], datasets: DatasetsParams, drops: Drops, role: str) -> list[dict[str, Any]]:
    """``role``'s SFT rows: its own calls (logical model ``role``) in the best rollout of each task group. Each row carries
    ``rejected``, the same agent's same call in the group's worst rollout (a lower reward), or None: the pair the
    trainer's held-out check compares (``train_sft.preference``), never trained on."""
    ranks = group_ranks(traces)
    worst = _worst_calls(traces, ranks, role)
    out: list[dict[str, Any]] = []
    for t in traces:
        where = f"rollout {t.rollout_id}"
        if t.status != "ok" or t.reward is None:
            drops.add("sft.rollout_failed", f"{where}: {(t.error or 'no reward')[:120]}")
            continue
        if t.reward < datasets.sft.min_reward:
            drops.add("sft.below_min_reward", f"{where}: reward {t.reward:.3f} < {datasets.sft.min_reward}")
            continue
        if ranks[t.rollout_id] >= datasets.sft.top_k:
            drops.add("sft.not_top_of_group", f"{where}: rank {ranks[t.rollout_id] + 1} in task {t.task_id}")
            continue
        low = worst.get(t.task_id)
        for key, d in _first_calls(t, role, drops):
            rejected = None
            if low is not None and low[0] < t.reward and key in low[1]:
                rejected = {"prompt": low[1][key]["messages"], "output": low[1][key]["output"], "reward": low[0]}
            out.append({"prompt": d["messages"], "completion": [{"role": "assistant", "content": d["output"]}],
                        "agent": d["agent"], "schema": d.get("schema"), "task_id": t.task_id, "rollout_id": t.rollout_id,
                        "run_id": t.run_id, "reward": t.reward, "rejected": rejected})
    return out


def _first_calls(t: Trace, role: str, drops: Drops | None = None) -> Iterable[tuple[tuple[str, int], dict[str, Any]]]:
    """``role``'s calls in ``t`` that parsed at their first attempt (a repaired answer was shown its own mistake, which
    the served model never is), keyed (agent, its n-th such call) so two rollouts of a task pair call for call."""
    seen: Counter = Counter()
    for d in _llm_calls(t, model=role):
        if d.get("attempt") != 1 or not d.get("parsed"):
            if drops is not None:
                drops.add("sft.call_not_parsed_first_attempt",
                          f"rollout {t.rollout_id}: {d.get('agent')} attempt {d.get('attempt')}")
            continue
        seen[d["agent"]] += 1
        yield (d["agent"], seen[d["agent"]]), d


def _worst_calls(traces: list[Trace], ranks: Mapping[str, int], role: str) -> dict[str, tuple[float, dict[Any, Any]]]:
    """task id -> (reward, ``role``'s first-attempt calls) of its lowest-ranked ok rollout."""
    last: dict[str, Trace] = {}
    for t in traces:
        if t.rollout_id in ranks and (t.task_id not in last or ranks[t.rollout_id] > ranks[last[t.task_id].rollout_id]):
            last[t.task_id] = t
    return {task: (t.reward or 0.0, dict(_first_calls(t, role))) for task, t in last.items()}


def rl_prompts(traces: list[Trace], tasks: Mapping[str, Mapping[str, Any]], agents: Mapping[str, str],
               drops: Drops) -> list[dict[str, Any]]:
    """The first-attempt structured calls of ``agents`` (agent -> the role that learns from it by RL)."""
    out: list[dict[str, Any]] = []
    for t in traces:
        task = tasks.get(t.task_id)
        if task is None:
            drops.add("rl.task_not_in_split", f"rollout {t.rollout_id}: task {t.task_id}")
            continue
        found = False
        for d in _llm_calls(t, agents=set(agents)):
            if d.get("attempt") != 1:
                continue  # repairs repeat the same prompt with the model's own mistake appended
            if not d.get("schema"):  # free text (the PI's decision path): GRPO samples and grades under a schema
                drops.add("rl.free_text_call", f"rollout {t.rollout_id}: {d.get('agent')}")
                continue
            found = True
            out.append({"prompt": d["messages"], "agent": d["agent"], "role": agents[d["agent"]], "schema": d["schema"],
                        "task_id": t.task_id, "rollout_id": t.rollout_id,
                        "run_id": t.run_id, "label": t.label or task.get("final_decision"), "question": task["question"],
                        "abstract": " ".join(task.get("contexts") or []), "rollout_reward": t.reward})
        if not found:
            drops.add("rl.no_trained_call", f"rollout {t.rollout_id}: {(t.error or 'no trained agent was called')[:120]}")
    return out


def bandit_examples(traces: list[Trace], drops: Drops) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in traces:
        where = f"rollout {t.rollout_id}"
        decisions = [s.data for s in t.spans if s.kind == "decision" and s.name == "supervisor"]
        if not decisions:
            drops.add("bandit.no_decision_span", f"{where}: {(t.error or 'supervisor never decided')[:120]}")
            continue
        d = decisions[0]
        candidates = d.get("candidate_hypotheses")
        if not candidates:
            drops.add("bandit.no_candidate_texts", f"{where}: decision span lacks candidate_hypotheses")
            continue
        if not d.get("pmf"):
            drops.add("bandit.no_logging_pmf", f"{where}: decision span lacks the logging policy's distribution (pmf)")
            continue
        if t.reward is None:
            drops.add("bandit.no_final_reward", f"{where}: {(t.error or 'not judged')[:120]}")
            continue
        context, actions = decision_features(str(d.get("context", "")), candidates)
        out.append({"rollout_id": t.rollout_id, "task_id": t.task_id, "run_id": t.run_id, "context": context, "actions": actions,
                    "candidates": [c.get("author") for c in candidates], "chosen": int(d["chosen"]),
                    "propensity": float(d["propensity"]), "logging_pmf": [float(p) for p in d["pmf"]],
                    "policy": d.get("policy", "llm"), "reward": float(t.reward)})
    return out
