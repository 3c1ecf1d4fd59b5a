"""The kinds of learning a role can have: the one home of that axis.

A kind is a params section (its settings, and under ``roles`` the roles that learn by it), a training stage
``train_<kind>`` (a DVC ``foreach`` over those roles, a DAG task mapped over them), the CLI command that stage runs
with ``--role``, and what its versions are registered as. The DAG reads this module while Airflow parses it: standard
library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal


class Learning(StrEnum):
    SFT = "sft"        # LoRA SFT on the role's own calls in the society's best traces
    PI = "pi"          # LoRA SFT on the gold decision (a role whose output the label checks)
    PPO = "ppo"        # online RL (TRL GRPO on CPU; verl through Agent Lightning on GPU)
    BANDIT = "bandit"  # a contextual bandit policy (Vowpal Wabbit) over the role's choices
    PROMPT = "prompt"  # few-shot prompt optimization through mlflow.genai.optimize_prompts

    @property
    def stage(self) -> str:
        return f"train_{self.value}"

    @property
    def command(self) -> str:
        return f"train-{self.value}"


@dataclass(frozen=True)
class Way:
    """How a kind of learning runs and what it leaves: the DAG, the registry and the docs read it here."""

    registers: Literal["llm", "policy"]  # llm: a version of the role's model (routed); policy: <role>_policy (a policy value)
    after: Literal["datasets", "validate"]  # what its data comes from: the rollouts' datasets, or the validated split
    gpu: bool  # a GPU stage in production: the `gpu` queue (and pool, when it trains weights)
    pool: bool
    timeout_h: int
    doc: str
    gpu_packages: tuple[str, ...] = ()  # what its stage imports on a GPU worker (`preflight gpu --imports` checks them)


_SFT_PACKAGES = ("torch", "transformers", "peft", "trl", "unsloth")
WAYS: dict[Learning, Way] = {
    Learning.SFT: Way("llm", "datasets", True, True, 6, "LoRA SFT on the role's calls in the best traces (TRL; unsloth on GPU)",
                      _SFT_PACKAGES),
    Learning.PI: Way("llm", "validate", True, True, 6, "LoRA SFT on the gold decision of the train split", _SFT_PACKAGES),
    Learning.PPO: Way("llm", "datasets", True, True, 12, "online RL (TRL GRPO on CPU; verl via Agent Lightning on GPU)",
                      ("torch", "vllm", "ray", "verl", "agentlightning", "peft")),
    Learning.BANDIT: Way("policy", "datasets", False, False, 2, "Vowpal Wabbit contextual bandit + off-policy evaluation"),
    Learning.PROMPT: Way("llm", "validate", True, False, 2, "few-shot demonstrations through mlflow.genai.optimize_prompts"),
}


def registered_name(kind: Learning, role: str) -> str:
    """The registered model a kind's versions of ``role`` belong to (a policy is registered beside the role's model)."""
    return f"{role}_policy" if WAYS[kind].registers == "policy" else role


PROMPT_ALIAS = "prompt"  # a prompt candidate is gated apart from the role's model: its entries are ROLE@prompt


def candidate_key(kind: Learning, role: str) -> str:
    """The key a kind's candidate of ``role`` has in evaluation and promotion (and its row of the cycle view)."""
    name = registered_name(kind, role)
    return f"{name}@{PROMPT_ALIAS}" if kind is Learning.PROMPT else name


def role_of(name: str) -> str:
    """The role a registered model belongs to (the inverse of :func:`registered_name`)."""
    return name.removesuffix("_policy")


def learners(raw: dict[str, Any]) -> dict[Learning, list[str]]:
    """Kind -> the roles that learn by it, from params as written (the DAG's parse-time view of the spec)."""
    return {kind: list(((raw.get(kind.value) or {}).get("roles")) or {}) for kind in Learning}
