"""The prompts every reader of a task shares: the evidence brief in PubMedQA's two settings and the PI's prompt.

Kept apart from the graph (and its langgraph import) because the model plane renders them too: train_pi writes the
PI's training rows from the same prompt the society and role-level evaluation send.
"""

from __future__ import annotations

from typing import Any

SETTINGS = ("reasoning_required", "reasoning_free")  # PubMedQA's two settings (data.setting)


def brief(task: dict[str, Any], context_chars: int, setting: str = "reasoning_required") -> str:
    """The question with its own abstract (PubMedQA's reasoning-required setting), the same for every split;
    reasoning-free adds the abstract's conclusion (the paper's long answer), first, so truncation never cuts it."""
    abstract = " ".join(task.get("contexts") or [])[:context_chars]
    text = task["question"]
    if setting == "reasoning_free" and task.get("long_answer"):
        text += f"\nConclusion: {task['long_answer']}"
    return f"{text}\nAbstract: {abstract}" if abstract else text


def pi_prompt(brief_text: str, protocol: Any, reviews: list[dict[str, Any]]) -> str:
    """The principal investigator's prompt (benchmarks/bench_before_after.py asks the trained PI the same)."""
    lines = "\n".join(f"- {r['reviewer']}: {r['severity']}: {r['summary']}" for r in reviews)
    return (f"You are the principal investigator. Question: {brief_text}\nProtocol: {protocol}\n"
            f"Reviews:\n{lines or 'none'}\nDecide GO or NO-GO with a rationale, as JSON.")


NO_PROTOCOL = "none yet: decide from the question and its abstract"


def pi_messages(task: dict[str, Any], context_chars: int, setting: str) -> list[dict[str, str]]:
    """The PI's chat on the evidence brief alone (no protocol, no reviews): role-level evaluation and its training rows."""
    return [{"role": "user", "content": pi_prompt(brief(task, context_chars, setting), NO_PROTOCOL, [])}]
