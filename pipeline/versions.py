"""One kind of version: what a switch moves, whether a role's model version or the prompt version it renders.

A :class:`Line` is one versioned thing of a role: its model (the MLflow model registry: a base model, a LoRA adapter, a
bandit policy) or one of its prompt templates (MLflow's Prompt Registry). Each line has the same verbs, so promotion,
approval, rollback, reconcile and the journal are written once (``pipeline/promotion.py``, ``stages/promote.py``,
``stages/rollback.py``) and a new artifact type is one more branch here, not a copy of each verb:

- ``get``/``named``/``champion``: a version by number, by alias, the champion;
- ``current``: the version the society is served now (a prompt: the one the live routing renders);
- ``sha256``: the digest a version was registered with (what the journal records and rollback checks);
- ``routed``: the routing table that serves a version (an adapter is deployed first), and what it replaced;
- ``drift``: how a version differs from what the promotion journal recorded of it (rollback and the audit refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline import prompt_registry, registry
from pipeline.agents import prompts
from pipeline.config import ServingParams
from pipeline.contracts import Artifact, Evaluation
from pipeline.serving import deploy, routing

CHAMPION = registry.CHAMPION  # the same alias name in both registries: what the society is served


class VersionError(RuntimeError):
    pass


@dataclass(frozen=True)
class Routed:
    """The routing table that serves a version, and where the role's calls went before and go after."""

    roles: dict[str, str]
    policies: dict[str, str]
    prompts: dict[str, int]
    pins: dict[str, str]
    deployment: str | None = None
    previous_deployment: str | None = None


@dataclass(frozen=True)
class Line:
    """A role's model (``template`` None) or the prompt ``template`` it renders."""

    role: str
    template: str | None = None

    @classmethod
    def of(cls, entry: Evaluation) -> Line:
        return cls(entry.role, entry.template if entry.artifact == Artifact.PROMPT else None)

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Line:
        """The line of a journal entry or a switch's intent (entries from before prompts switched carry no kind)."""
        return cls(record["role"], record.get("template") if record.get("kind", Artifact.MODEL) == Artifact.PROMPT else None)

    @property
    def artifact(self) -> Artifact:
        return Artifact.MODEL if self.template is None else Artifact.PROMPT

    @property
    def label(self) -> str:
        return self.role if self.template is None else f"prompt {self.template}"

    @property
    def store(self) -> str:
        return "registry" if self.template is None else "Prompt Registry"

    def candidate_alias(self, alias: str) -> str:
        """The alias a candidate of this line is registered under (a prompt's evaluation entry is ``ROLE@prompt``)."""
        return alias if self.template is None else prompt_registry.CHALLENGER

    def get(self, version: str | int) -> Any | None:
        if self.template is not None:
            return prompt_registry.load(self.template, int(version))
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - mlflow: control plane only

        try:
            return registry.get_version(self.role, version)
        except MlflowException:
            return None

    def named(self, alias: str) -> Any | None:
        if self.template is not None:
            return prompt_registry.load(self.template, f"@{alias}")
        return registry.by_alias(self.role, alias)

    def champion(self) -> Any | None:
        return self.named(CHAMPION)

    def current(self, live: dict[str, Any] | None) -> str | None:
        """The version served now: a model's champion; the prompt version the live routing renders."""
        if self.template is not None:
            number = prompt_registry.rendered(live, self.template)
            return str(number) if number is not None else None
        champion = self.champion()
        return str(champion.version) if champion is not None else None

    def set_alias(self, alias: str, version: str | int) -> None:
        if self.template is not None:
            prompt_registry.set_alias(self.template, alias, version)
        else:
            registry.set_alias(self.role, alias, version)

    def delete_alias(self, alias: str) -> None:
        """Remove ``alias`` if it names a version (deciding a candidate twice must not fail on its alias)."""
        if self.template is not None:
            prompt_registry.delete_alias(self.template, alias)
        elif registry.by_alias(self.role, alias) is not None:
            registry.delete_alias(self.role, alias)

    def set_tags(self, version: str | int, tags: dict[str, Any]) -> None:
        if self.template is not None:
            prompt_registry.set_tags(self.template, version, tags)
        else:
            registry.set_tags(self.role, version, tags)

    def sha256(self, version: Any) -> str | None:
        """The digest ``version`` was registered with (a base model version has none)."""
        return version.tags.get(registry.SHA256_TAG if self.template is None else "sha")

    def stale(self, entry: Evaluation, current: str | None) -> str | None:
        """Why ``entry``'s evidence no longer applies (the versions it compared are not the ones served), else None."""
        if self.template is None:
            if str(entry.champion.version) != str(current):
                return (f"evaluated against champion v{entry.champion.version}, but the champion is now v{current}; "
                        "evaluate again")
            return None
        model = registry.by_alias(self.role, registry.CHAMPION)
        if str(entry.champion.version) != str(current) or str(entry.model_version) != str(model and model.version):
            return (f"evaluated as prompt v{entry.champion.version} -> v{entry.candidate.version} on model "
                    f"v{entry.model_version}, but the role renders prompt v{current} on model "
                    f"v{model and model.version} now; evaluate again")
        return None

    def routed(self, serving: ServingParams, live: dict[str, Any], to: Any) -> Routed:
        """The routing table with this line served by ``to``: an adapter is hot-loaded first, a prompt version is
        routed and pinned by its text's digest; every other role, policy and prompt is kept."""
        roles, policies = dict(live["roles"]), dict(live.get("policies", {}))
        routed_prompts = dict(live.get("prompts") or {})
        if self.template is not None:
            routed_prompts[self.template] = int(to.version)
            pins = {**routing.pins_kept(live, routed_prompts), self.template: prompts.digest(str(to.template))}
            return Routed(roles, policies, routed_prompts, pins)
        try:
            where = deploy.deploy(serving, self.role, to, roles.get(self.role))
        except registry.RegistryError as exc:
            raise VersionError(str(exc)) from exc
        table = policies if deploy.routes_policy(to) else roles
        # what was routed, both sides, base versions included: rollback and the audit compare against these, never
        # against a registry tag (a base version's `deployment` tag has no digest to check it by)
        previous = table.get(self.role, "llm" if table is policies else None)
        table[self.role] = where
        return Routed(roles, policies, routed_prompts, routing.pins_kept(live, routed_prompts), where, previous)

    def drift(self, serving: ServingParams, version: Any, sha256: str | None, deployment: str | None,
              when: str) -> str | None:
        """How ``version`` differs from what the promotion journal recorded of it (``when`` it did: "made it
        champion", "recorded it as champion"): its digest (a prompt: its text's too) and, for a model, where it is
        routed (a base version has no digest: the journal's record, never its writable ``deployment`` tag). None:
        it is what the journal recorded."""
        tagged = self.sha256(version)
        if self.template is not None:
            sha = prompts.digest(str(version.template))
            if sha != sha256 or tagged != sha:
                return (f"prompt {self.template} v{version.version}: its text hashes to {sha} (tag {tagged}), but "
                        f"{sha256} when the promotion journal {when}")
            return None
        if tagged != sha256:
            return (f"{self.role} v{version.version}: sha256 {tagged} in the registry, but {sha256} when the promotion "
                    f"journal {when}")
        if deployment:
            try:
                where = deploy.target(serving, self.role, version)
            except registry.RegistryError as exc:
                where = f"nothing ({exc})"
            if where != deployment:
                return (f"{self.role} v{version.version}: the registry routes it to {where}, but the promotion journal "
                        f"recorded {deployment} when it {when}")
        return None
