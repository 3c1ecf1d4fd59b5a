"""The kinds of registered version a role can have: what its artifact is and how the society reaches it.

One home for the axis: the registry's baselines, registration, routing targets and deployment read it here, so a new
kind (a prompt version, issue #43) is one entry, not another branch in each of them.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    BASE = "base"  # a role's baseline: the base model its routing deployment serves (tag ``deployment``)
    LORA_ADAPTER = "lora_adapter"  # a LoRA folder hot-loaded into the worker serving the role
    CONTEXTUAL_BANDIT = "contextual_bandit"  # a VW policy file the supervisor loads by its ``models:/`` URI
    LLM_SUPERVISOR = "llm_supervisor"  # the supervisor's baseline: the LLM picks, no policy file

    @property
    def hot_loaded(self) -> bool:
        """Its artifact must be loaded into a worker before the society can reach it."""
        return self is Kind.LORA_ADAPTER

    @property
    def policy(self) -> bool:
        """The society reaches it through the routing's ``policies`` (the supervisor's pick), not a deployment."""
        return self in (Kind.CONTEXTUAL_BANDIT, Kind.LLM_SUPERVISOR)

    def target(self, role: str, version: str, deployment: str | None, worker: str | None, adapter: str | None) -> str:
        """Where the society reaches a version of this kind: a routing deployment (LLM roles) or a policy value."""
        match self:
            case Kind.BASE:
                if not deployment:
                    raise ValueError(f"{role} v{version}: a base version without its deployment tag")
                return deployment
            case Kind.LORA_ADAPTER:
                return f"{worker}/{adapter}"
            case Kind.CONTEXTUAL_BANDIT:
                return f"models:/{role}/{version}"
            case Kind.LLM_SUPERVISOR:
                return "llm"
