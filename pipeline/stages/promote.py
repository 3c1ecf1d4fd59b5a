"""Promote each evaluated candidate that beat its champion; ``rollback ROLE`` undoes a promotion.

The gate (``pipeline.evaluation.gate``) reads the evaluate stage's summary. A promotion then, in
order: makes the candidate reachable (hot-loads its adapter into the worker serving the role),
writes a new routing version with the role pointed at it, applies it (the proxy verifies every
role live; a failed verification restores the previous version), and only then moves the
``champion`` alias. Any failure leaves alias and live routing as they were and exits non-zero with
the cause. The decision and its evidence are tags on the candidate version and a ``promote`` MLflow
run, which also keeps the routing version file as an artifact; ``reports/promotion.json`` says
what was decided (the DAG branches on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlflow import active_run, log_artifact, log_dict, log_metric

from pipeline import metrics_files, prompt_registry, registry, tracking
from pipeline.config import EvaluateParams, MlflowParams, Params, PromoteParams, ServingParams
from pipeline.contracts import Artifact, Evaluation, EvaluationSummary, Level, PromotionDecision, PromotionReport, Status
from pipeline.evaluation.gate import INSUFFICIENT, Decision, decide, family_p_values
from pipeline.io import write_json
from pipeline.promotion import PROMPT, PromotionError, reconcile, rolled_back_after, switch, switch_prompt
from pipeline.serving import routing, stack

__all__ = ["PromotionError", "promote_all", "promote_role", "switch"]

METRICS_FILE = Path("reports/promotion.json")


def _active_run_id() -> str:
    run = active_run()
    return run.info.run_id if run else ""


HISTORY = (Status.PROMOTED, Status.REJECTED, "rolled_back")  # decisions a rerun on the same evidence must not rewrite


def _decided(tags: dict[str, str], entry: Evaluation) -> str | None:
    """The decision recorded on a version from this very evaluation (its candidate run), if it is one that is history:
    re-running ``promote`` on the same summary reports it again instead of rewriting it (an A/A refused on
    discrimination must not become 'stale' because its champion moved since)."""
    if tags.get("promotion.decision") not in HISTORY:
        return None
    try:
        evidence = json.loads(tags.get("promotion.evidence") or "{}")
    except json.JSONDecodeError:
        return None
    return str(tags["promotion.decision"]) if evidence.get("candidate_run") == entry.candidate.run_id else None


def _again(name: str, version: str, decided: str, tags: dict[str, str], evidence: dict, where: dict) -> PromotionDecision:
    print(f"promote: {name} v{version} was decided {decided!r} on this evaluation by run {tags.get('promotion.run', '?')}; "
          "a decision is history (evaluate again for a new one)")
    return PromotionDecision(candidate=version, status=Status.REJECTED, rule="decided",
                             detail=f"decided {decided} before ({tags.get('promotion.rule', '')}: "
                                    f"{tags.get('promotion.detail', '')})"[:4000], **evidence, **where)


def _status(decision: Decision, promote: PromoteParams) -> Status:
    if decision.promote:
        return Status.DRY_RUN if promote.dry_run else Status.PROMOTED
    return Status.INSUFFICIENT_EVIDENCE if decision.rule == INSUFFICIENT else Status.REJECTED


def promote_role(serving: ServingParams, mlflow: MlflowParams, promote: PromoteParams, name: str, entry: Evaluation,
                 current_champion: str, adjusted_p: float | None = None, family: int = 1,
                 evaluated_at: str | None = None) -> PromotionDecision:
    cand = registry.get_version(name, entry.candidate.version)
    evidence = {"p_value": entry.difference.p_value, "p_adjusted": adjusted_p, "family": family,
                "candidate_reward": entry.candidate.metrics.reward.mean, "champion_reward": entry.champion.metrics.reward.mean,
                "difference": entry.difference.model_dump(mode="json")}
    where = {"role": name, "alias": entry.alias, "level": entry.level, "setting": entry.candidate.metrics.setting}
    if str(cand.version) == str(current_champion) and cand.tags.get("promotion.decision") == Status.PROMOTED:
        # a retried promote (the DAG retries the task) after this switch completed: recognise it, change nothing
        print(f"promote: {name} v{cand.version} was already promoted by run {cand.tags.get('promotion.run', '?')}")
        if registry.by_alias(name, entry.alias) is not None:
            registry.delete_alias(name, entry.alias)
        return PromotionDecision(candidate=cand.version, champion_before=cand.tags.get("promotion.previous_champion") or None,
                                 status=Status.PROMOTED, promote=True, rule=cand.tags.get("promotion.rule", ""),
                                 detail=cand.tags.get("promotion.detail", "already promoted"),
                                 routing_version=int(cand.tags.get("promotion.routing_version", 0)) or None, already=True,
                                 **evidence, **where)
    if (decided := _decided(cand.tags, entry)) is not None:
        if registry.by_alias(name, entry.alias) is not None:
            registry.delete_alias(name, entry.alias)
        return _again(name, cand.version, decided, cand.tags, evidence, where)
    if str(entry.champion.version) != str(current_champion):
        decision = Decision(False, "stale", f"evaluated against champion v{entry.champion.version}, "
                                            f"but the champion is now v{current_champion}; evaluate again")
    elif (when := rolled_back_after(serving, name, evaluated_at)) is not None:
        decision = Decision(False, "stale", f"{name} was rolled back at {when}, after this evaluation "
                                            f"({evaluated_at or 'of unknown time'}); evaluate again")
    else:
        decision = decide(entry.candidate.metrics, entry.champion.metrics, entry.difference, promote, adjusted_p, family)
    status = _status(decision, promote)
    out = PromotionDecision(candidate=cand.version, champion_before=current_champion or None, status=status,
                            **decision.as_dict(), **evidence, **where)
    tags = {"promotion.decision": status.value, "promotion.rule": decision.rule, "promotion.detail": decision.detail[:4000],
            "promotion.run": _active_run_id(),
            "promotion.evidence": json.dumps({"candidate_run": entry.candidate.run_id, "champion_run": entry.champion.run_id,
                                              "p_adjusted": adjusted_p, "family": family,
                                              "difference": evidence["difference"]})[:4000]}
    if status == Status.PROMOTED:
        try:  # the decision's tags are written by the switch itself, once the alias moved (or by a reconcile after a crash)
            out.routing_version = switch(serving, mlflow, promote, name, cand,
                                         f"promote {name} v{cand.version}: {decision.detail}", tags=tags)
        except PromotionError as exc:
            registry.set_tags(name, cand.version, {"promotion.decision": Status.FAILED.value, "promotion.rule": "deployment",
                                                   "promotion.detail": str(exc)[:4000], "promotion.run": _active_run_id()})
            raise
        log_artifact(str(routing.version_path(serving, out.routing_version)), artifact_path="routing")
    else:
        registry.set_tags(name, cand.version, tags)
    registry.delete_alias(name, entry.alias)  # decided: the next cycle's trainer names the next challenger
    return out


def promote_prompt(serving: ServingParams, mlflow: MlflowParams, promote: PromoteParams, entry: Evaluation,
                   model_champion: str, adjusted_p: float | None = None, family: int = 1,
                   evaluated_at: str | None = None) -> PromotionDecision:
    """A prompt pair (champion weights, candidate prompt) against (champion weights, rendered prompt): the same rules;
    a promotion routes the role's template to the version and moves the prompt's ``champion`` alias."""
    name, template = entry.role, str(entry.template)
    cand = prompt_registry.load(template, entry.candidate.version)
    if cand is None:
        raise PromotionError(f"prompt {template} v{entry.candidate.version}: not in the Prompt Registry")
    current = prompt_registry.rendered(routing.active(serving), template)
    evidence = {"p_value": entry.difference.p_value, "p_adjusted": adjusted_p, "family": family,
                "candidate_reward": entry.candidate.metrics.reward.mean, "champion_reward": entry.champion.metrics.reward.mean,
                "difference": entry.difference.model_dump(mode="json")}
    where = {"role": name, "alias": entry.alias, "level": entry.level, "setting": entry.candidate.metrics.setting,
             "artifact": Artifact.PROMPT, "template": template}
    if str(cand.version) == str(current) and cand.tags.get("promotion.decision") == Status.PROMOTED:
        print(f"promote: prompt {template} v{cand.version} was already promoted")  # a retried promote after its switch
        prompt_registry.delete_alias(template, prompt_registry.CHALLENGER)
        return PromotionDecision(candidate=cand.version, champion_before=cand.tags.get("promotion.previous_champion") or None,
                                 status=Status.PROMOTED, promote=True, rule=cand.tags.get("promotion.rule", ""),
                                 detail=cand.tags.get("promotion.detail", "already promoted"), already=True,
                                 **evidence, **where)
    if (decided := _decided(cand.tags, entry)) is not None:
        prompt_registry.delete_alias(template, prompt_registry.CHALLENGER)
        return _again(f"prompt {template}", cand.version, decided, cand.tags, evidence, where)
    if str(entry.champion.version) != str(current) or str(entry.model_version) != str(model_champion):
        decision = Decision(False, "stale", f"evaluated as prompt v{entry.champion.version} -> v{cand.version} on model "
                                            f"v{entry.model_version}, but the role renders prompt v{current} on model "
                                            f"v{model_champion} now; evaluate again")
    elif (when := rolled_back_after(serving, name, evaluated_at, PROMPT, template)) is not None:
        decision = Decision(False, "stale", f"prompt {template} was rolled back at {when}, after this evaluation "
                                            f"({evaluated_at or 'of unknown time'}); evaluate again")
    else:
        decision = decide(entry.candidate.metrics, entry.champion.metrics, entry.difference, promote, adjusted_p, family)
    status = _status(decision, promote)
    out = PromotionDecision(candidate=cand.version, champion_before=str(current) if current is not None else None,
                            status=status, **decision.as_dict(), **evidence, **where)
    tags = {"promotion.decision": status.value, "promotion.rule": decision.rule, "promotion.detail": decision.detail[:4000],
            "promotion.run": _active_run_id(), "promotion.model_version": str(entry.model_version),
            "promotion.evidence": json.dumps({"candidate_run": entry.candidate.run_id, "champion_run": entry.champion.run_id,
                                              "p_adjusted": adjusted_p, "family": family})[:4000]}
    if status == Status.PROMOTED:
        try:
            out.routing_version = switch_prompt(serving, mlflow, name, template, cand,
                                                f"promote prompt {template} v{cand.version}: {decision.detail}", tags=tags)
        except PromotionError as exc:
            prompt_registry.set_tags(template, cand.version, {"promotion.decision": Status.FAILED.value,
                                                              "promotion.rule": "deployment", "promotion.detail": str(exc)})
            raise
        log_artifact(str(routing.version_path(serving, out.routing_version)), artifact_path="routing")
    else:
        prompt_registry.set_tags(template, cand.version, tags)
    prompt_registry.delete_alias(template, prompt_registry.CHALLENGER)  # decided: the next optimizer names the next one
    return out


def promote_all(evaluate: EvaluateParams, promote: PromoteParams, serving: ServingParams,
                mlflow: MlflowParams, gates: dict[str, PromoteParams] | None = None) -> PromotionReport:
    """Decide every evaluated candidate, each by its role's gate values (``gates``: role -> ``promote`` with the role's
    own, ``Params.gate``); the Holm family spans the whole cycle."""
    reconcile(serving, mlflow)
    summary = EvaluationSummary.model_validate_json(Path(evaluate.out_dir, "summary.json").read_text())
    decisions: dict[str, PromotionDecision] = {}
    failure: PromotionError | None = None
    adjusted, family = family_p_values({key: entry.difference.p_value for key, entry in summary.roles.items()}, promote)
    # A/A candidates first: each is decided against the champion it was evaluated with, before a challenger may move it
    for key, entry in sorted(summary.roles.items(), key=lambda kv: kv[1].alias != registry.AA):
        name = entry.role
        champion = registry.by_alias(name, registry.CHAMPION)
        gate = (gates or {}).get(name, promote)
        try:
            if entry.artifact == Artifact.PROMPT:
                decisions[key] = promote_prompt(serving, mlflow, gate, entry, champion.version if champion else "",
                                                adjusted[key], family, summary.created_at)
            else:
                decisions[key] = promote_role(serving, mlflow, gate, name, entry, champion.version if champion else "",
                                              adjusted[key], family, summary.created_at)
        except PromotionError as exc:
            decisions[key] = PromotionDecision(candidate=entry.candidate.version, status=Status.FAILED, rule="deployment",
                                               detail=str(exc), role=name, alias=entry.alias, level=entry.level,
                                               setting=entry.candidate.metrics.setting, artifact=entry.artifact,
                                               template=entry.template)
            failure = failure or exc
        d = decisions[key]
        print(f"promote: {key} v{d.candidate}: {d.status.upper()} ({d.rule}): {d.detail}")
        log_metric(f"{key.replace('@', '.')}.promoted", float(d.status == Status.PROMOTED))
    for key, skipped in summary.unevaluated.items():  # too few tasks to evaluate: the gate's first rule, without the run
        decisions[key] = PromotionDecision(candidate=skipped.version, status=Status.INSUFFICIENT_EVIDENCE, rule=INSUFFICIENT,
                                           detail=skipped.reason, role=skipped.role, alias=skipped.alias,
                                           level=Level.SOCIETY, setting=summary.setting)
        registry.set_tags(skipped.role, skipped.version, {"promotion.decision": Status.INSUFFICIENT_EVIDENCE.value,
                                                          "promotion.rule": INSUFFICIENT, "promotion.detail": skipped.reason,
                                                          "promotion.run": _active_run_id()})
        if registry.by_alias(skipped.role, skipped.alias) is not None:
            registry.delete_alias(skipped.role, skipped.alias)  # decided: the next cycle's trainer names the next one
        print(f"promote: {key} v{skipped.version}: INSUFFICIENT_EVIDENCE (not evaluated): {skipped.reason}")
        log_metric(f"{key}.promoted", 0.0)
    live = routing.active(serving)
    champions = {n: (v.version if (v := registry.by_alias(n, registry.CHAMPION)) else None) for n in promote.roles}
    result = PromotionReport(promoted=sorted(n for n, d in decisions.items() if d.status == Status.PROMOTED),
                             decisions=decisions, setting=summary.setting, champions=champions,
                             routing_version=live and live["version"], dry_run=promote.dry_run)
    log_dict(result.model_dump(mode="json"), "promotion.json")
    if failure is not None:
        _write(result)
        raise failure
    return result


def _write(result: PromotionReport) -> None:
    doc = result.model_dump(mode="json")
    write_json(METRICS_FILE, doc)
    metrics_files.write("promote", doc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)  # reconciles a switch a crash interrupted before anything else
    try:
        with tracking.stage_run("promote", params.mlflow) as run:
            result = promote_all(params.evaluate, params.promote, params.serving, params.mlflow,
                                 {name: params.gate(name) for name in params.promote.roles})
    except PromotionError as exc:
        print(f"error: promotion failed, champion alias and live routing unchanged: {exc}", file=sys.stderr)
        return 1
    _write(result)
    print(f"promote: promoted {result.promoted or 'nothing'}; champions {result.champions}; "
          f"routing v{result.routing_version} live; evidence in MLflow run {run.info.run_id}")
    return 0

