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
import os
import sys
from pathlib import Path
from typing import Any

from mlflow import active_run, log_artifact, log_dict, log_metric

from pipeline import contracts, metrics_files, registry, tracking
from pipeline.config import EvaluateParams, MlflowParams, Params, PromoteParams, ServingParams
from pipeline.contracts import Artifact, Evaluation, EvaluationSummary, Level, PromotionDecision, PromotionReport, Status
from pipeline.evaluation.gate import INSUFFICIENT, Decision, decide, family_p_values
from pipeline.io import write_json
from pipeline.promotion import PromotionError, reconcile, record_not_approved, rolled_back_after, switch
from pipeline.serving import routing, stack
from pipeline.versions import Line

__all__ = ["PromotionError", "promote_all", "promote_candidate", "switch"]

METRICS_FILE = Path("reports/promotion.json")


def _active_run_id() -> str:
    run = active_run()
    return run.info.run_id if run else ""


# decisions a rerun on the same evidence must not rewrite (a person's no included: it is not asked again)
HISTORY = (Status.PROMOTED, Status.REJECTED, Status.NOT_APPROVED, Status.ROLLED_BACK)


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


def _evidence(entry: Evaluation, tags: dict[str, str], adjusted_p: float | None, family: int) -> dict[str, Any]:
    """What a decision is recorded with (reports/promotion.json, the approval form): the figures the gate read."""
    return {"p_value": entry.difference.p_value, "p_adjusted": adjusted_p, "family": family,
            "candidate_reward": entry.candidate.metrics.reward.mean, "champion_reward": entry.champion.metrics.reward.mean,
            "difference": entry.difference.model_dump(mode="json"), "auc": tags.get("eval.auc"),
            "run_url": tags.get("eval.run_url") or _run_url(entry.candidate.run_id)}


def _run_url(run_id: str | None) -> str | None:
    """The candidate's evaluation run in the MLflow UI, for a version evaluate did not tag (evidence from elsewhere)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - loaded already (mlflow is imported at the top)

    try:
        return tracking.run_url(run_id) if run_id else None
    except MlflowException:
        return None


def _status(decision: Decision, promote: PromoteParams) -> Status:
    if decision.promote:
        return Status.DRY_RUN if promote.dry_run else Status.PROMOTED
    return Status.INSUFFICIENT_EVIDENCE if decision.rule == INSUFFICIENT else Status.REJECTED


def promote_candidate(serving: ServingParams, mlflow: MlflowParams, promote: PromoteParams, entry: Evaluation,
                      adjusted_p: float | None = None, family: int = 1, evaluated_at: str | None = None) -> PromotionDecision:
    """Decide one evaluated candidate (a model version, or a prompt version with the champion weights) by the gate's
    rules, and switch it in when they say so: the same path for every kind of version."""
    line = Line.of(entry)
    cand = line.get(entry.candidate.version)
    if cand is None:
        raise PromotionError(f"{line.label} v{entry.candidate.version}: not in the {line.store}")
    current = line.current(routing.active(serving))
    evidence = _evidence(entry, cand.tags, adjusted_p, family)
    where = {"role": line.role, "alias": entry.alias, "level": entry.level, "setting": entry.candidate.metrics.setting,
             "artifact": line.artifact, "template": line.template}
    alias = line.candidate_alias(entry.alias)
    if str(cand.version) == str(current) and cand.tags.get("promotion.decision") == Status.PROMOTED:
        # a retried promote (the DAG retries the task) after this switch completed: recognise it, change nothing
        print(f"promote: {line.label} v{cand.version} was already promoted by run {cand.tags.get('promotion.run', '?')}")
        line.delete_alias(alias)
        return PromotionDecision(candidate=cand.version, champion_before=cand.tags.get("promotion.previous_champion") or None,
                                 status=Status.PROMOTED, promote=True, rule=cand.tags.get("promotion.rule", ""),
                                 detail=cand.tags.get("promotion.detail", "already promoted"),
                                 routing_version=int(cand.tags.get("promotion.routing_version", 0)) or None, already=True,
                                 **evidence, **where)
    if (decided := _decided(cand.tags, entry)) is not None:
        line.delete_alias(alias)
        return _again(line.label, cand.version, decided, cand.tags, evidence, where)
    if (why := line.stale(entry, current)) is not None:
        decision = Decision(False, "stale", why)
    elif (when := rolled_back_after(serving, line, evaluated_at)) is not None:
        decision = Decision(False, "stale", f"{line.label} was rolled back at {when}, after this evaluation "
                                            f"({evaluated_at or 'of unknown time'}); evaluate again")
    else:
        decision = decide(entry.candidate.metrics, entry.champion.metrics, entry.difference, promote, adjusted_p, family)
    status = _status(decision, promote)
    out = PromotionDecision(candidate=cand.version, champion_before=current, status=status, **decision.as_dict(),
                            **evidence, **where)
    tags = {**_decision_tags(status, decision, adjusted_p, family),
            "promotion.evidence": json.dumps({"candidate_run": entry.candidate.run_id, "champion_run": entry.champion.run_id,
                                              "p_adjusted": adjusted_p, "family": family,
                                              "difference": evidence["difference"]})[:4000]}
    if line.template is not None:  # a prompt's evidence holds for the weights it was rendered with
        tags["promotion.model_version"] = str(entry.model_version)
    if status == Status.PROMOTED and promote.approval == "required":
        # the role's gate asks a person first: the decision and its evidence on the version, the candidate keeps its
        # alias, nothing is switched until `settle`
        line.set_tags(cand.version, {**tags, "promotion.decision": Status.AWAITING_APPROVAL.value})
        out.status = Status.AWAITING_APPROVAL
        return out
    if status == Status.PROMOTED:
        try:  # the decision's tags are written by the switch itself, once the alias moved (or by a reconcile after a crash)
            out.routing_version = switch(serving, mlflow, line, cand, f"promote {line.label} v{cand.version}: "
                                         f"{decision.detail}", tags=tags)
        except PromotionError as exc:
            line.set_tags(cand.version, {"promotion.decision": Status.FAILED.value, "promotion.rule": "deployment",
                                         "promotion.detail": str(exc)[:4000], "promotion.run": _active_run_id()})
            raise
        log_artifact(str(routing.version_path(serving, out.routing_version)), artifact_path="routing")
    else:
        line.set_tags(cand.version, tags)
    line.delete_alias(alias)  # decided: the next cycle's trainer (or optimizer) names the next challenger
    return out


def _decision_tags(status: Status, decision: Decision, adjusted_p: float | None, family: int) -> dict[str, str]:
    """What the gate decided, on the version beside its evidence (``eval.*``): the rule, why, the p it decided on."""
    return {"promotion.decision": status.value, "promotion.rule": decision.rule, "promotion.detail": decision.detail[:4000],
            "promotion.run": _active_run_id(), "promotion.family": str(family),
            "promotion.p_adjusted": "" if adjusted_p is None else f"{adjusted_p:.4g}"}


def promote_all(evaluate: EvaluateParams, promote: PromoteParams, serving: ServingParams,
                mlflow: MlflowParams, gates: dict[str, PromoteParams] | None = None) -> PromotionReport:
    """Decide every evaluated candidate, each by its role's gate values (``gates``: role -> ``promote`` with the role's
    own, ``Params.gate``); the Holm family spans the whole cycle."""
    reconcile(serving, mlflow)
    summary = contracts.read(EvaluationSummary, Path(evaluate.out_dir, "summary.json"))
    decisions: dict[str, PromotionDecision] = {}
    failure: PromotionError | None = None
    adjusted, family = family_p_values({key: entry.difference.p_value for key, entry in summary.roles.items()}, promote)
    # A/A candidates first: each is decided against the champion it was evaluated with, before a challenger may move it
    for key, entry in sorted(summary.roles.items(), key=lambda kv: kv[1].alias != registry.AA):
        name = entry.role
        try:
            decisions[key] = promote_candidate(serving, mlflow, (gates or {}).get(name, promote), entry, adjusted[key],
                                               family, summary.created_at)
        except PromotionError as exc:
            decisions[key] = PromotionDecision(candidate=entry.candidate.version, status=Status.FAILED, rule="deployment",
                                               detail=str(exc), role=name, alias=entry.alias, level=entry.level,
                                               setting=entry.candidate.metrics.setting, artifact=entry.artifact,
                                               template=entry.template)
            failure = failure or exc
        d = decisions[key]
        print(f"promote: {key} v{d.candidate}: {d.status.upper()} ({d.rule}): {d.detail}")
        if d.status == Status.AWAITING_APPROVAL:
            print(f"promote: {key} v{d.candidate} waits for a person: approve it in the Airflow UI, or "
                  f"`python -m pipeline promote --approve {key}` (`--reject {key}`)")
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


# whole Params: the answer reads serving, mlflow and promote
def settle(params: Params, key: str, approve: bool, by: str, why: str) -> PromotionDecision:
    """A person's answer to a candidate awaiting approval (``reports/promotion.json``): approved, it goes through the
    same crash-safe switch a gate's promotion does; refused, it is ``not_approved`` on the version and in the journal
    and nothing moves. The same answer again (a retried Airflow task, a rerun after a crash between the switch and the
    report) finishes the record and changes nothing else. Refused in one line when it is not awaiting, or when its
    alias or its champion moved since the gate decided (the evidence is stale: evaluate again)."""
    answered = Status.PROMOTED if approve else Status.NOT_APPROVED
    result, d = _awaiting(key, answered)
    serving, line = params.serving, Line(str(d.role), str(d.template) if d.artifact == Artifact.PROMPT else None)
    alias = line.candidate_alias(str(d.alias))
    cand = line.get(d.candidate)
    if cand is None:
        raise PromotionError(f"{key} v{d.candidate}: no such version in the {line.store}")
    current = line.current(routing.active(serving))
    tagged = cand.tags.get("promotion.decision")
    if tagged == answered and (not approve or str(current) == str(d.candidate)):
        print(f"promote: {key} v{d.candidate} was {answered} already (a repeated answer): recording it, nothing else")
        d.routing_version = int(cand.tags.get("promotion.routing_version") or 0) or d.routing_version
    else:
        _still_as_decided(key, d, line, alias, tagged, current)
        _answer(params, key, d, line, cand, approve, by, why)
    if d.status != answered:
        d.detail = d.detail if approve else f"not approved by {by}: {why}"[:4000]
    d.status, d.promote = answered, approve
    result.promoted = sorted({*result.promoted, key} if approve else set(result.promoted) - {key})
    line.delete_alias(alias)
    live = routing.active(serving)
    result.champions = {n: (v.version if (v := registry.by_alias(n, registry.CHAMPION)) else None)
                        for n in params.promote.roles}
    result.routing_version = live["version"] if live else None
    _write(result)
    print(f"promote: {key} v{d.candidate}: {d.status.upper()} by {by}; routing v{result.routing_version} live")
    return d


# whole Params: serving and mlflow (the switch)
def _answer(params: Params, key: str, d: PromotionDecision, line: Line, cand: Any, approve: bool, by: str, why: str) -> None:
    """Approved: the candidate through the same switch a promotion takes, the person's answer on it; refused: the
    answer on the version and in the journal, nothing switched."""
    answer = {"promotion.approved_by" if approve else "promotion.refused_by": by, "promotion.answer": why[:4000]}
    if approve:
        tags = {**{k: v for k, v in cand.tags.items() if k.startswith("promotion.")}, **answer,
                "promotion.decision": Status.PROMOTED.value, "promotion.run": _active_run_id()}
        d.routing_version = switch(params.serving, params.mlflow, line, cand,
                                   f"promote {key} v{d.candidate} (approved by {by}): {d.detail}", tags=tags)
    else:
        line.set_tags(d.candidate, {**answer, "promotion.decision": Status.NOT_APPROVED.value})
        record_not_approved(params.serving, line, d.candidate, by, why)


def _awaiting(key: str, answered: Status) -> tuple[PromotionReport, PromotionDecision]:
    """The cycle's report and ``key``'s decision, which must await approval (or carry this very answer already)."""
    result = contracts.read(PromotionReport, METRICS_FILE) if METRICS_FILE.exists() else None
    d = result.decisions.get(key) if result else None
    if result is None or d is None or d.status not in (Status.AWAITING_APPROVAL, answered):
        waiting = sorted(k for k, v in (result.decisions if result else {}).items() if v.status == Status.AWAITING_APPROVAL)
        raise PromotionError(f"{key or repr(key)} is not awaiting approval in {METRICS_FILE} (its decision: "
                             f"{d.status if d else 'none'}; awaiting: {waiting or 'nothing'})")
    return result, d


def _still_as_decided(key: str, d: PromotionDecision, line: Line, alias: str, tagged: str | None,
                      current: str | None) -> None:
    """Refuse an answer to evidence that went stale: the version no longer awaits, its alias or the champion moved."""
    if tagged != Status.AWAITING_APPROVAL:
        raise PromotionError(f"{key} v{d.candidate} is not awaiting approval in the {line.store} ({tagged})")
    named = line.named(alias)
    if named is None or str(named.version) != str(d.candidate) or str(current) != str(d.champion_before):
        raise PromotionError(f"{key} v{d.candidate} was decided against v{d.champion_before} as {d.alias}; now the champion "
                             f"is v{current} and {d.alias} is v{named.version if named else '-'}: evaluate again")


def approval_request(key: str) -> str | None:
    """What a person is shown before approving ``key`` (Markdown: the Airflow approval task's body): the candidate
    against its champion, the paired difference with its interval and n, the exact tests, the AUC, the gate's rule and
    the evaluation run. None when ``key`` is not awaiting approval."""
    result = contracts.read(PromotionReport, METRICS_FILE) if METRICS_FILE.exists() else None
    d = result.decisions.get(key) if result else None
    if d is None or d.status != Status.AWAITING_APPROVAL:
        return None
    nan, diff = float("nan"), d.difference
    what = f"prompt {d.template} " if d.artifact == Artifact.PROMPT else ""
    lines = [f"**{key}**: {what}v{d.candidate} against the champion v{d.champion_before} ({d.level} level, {d.setting})",
             f"- reward {d.candidate_reward if d.candidate_reward is not None else nan:.3f} vs "
             f"{d.champion_reward if d.champion_reward is not None else nan:.3f}"
             + (f": paired difference {diff.mean:+.3f}, {diff.ci:.0%} CI [{diff.ci_low:+.3f}, {diff.ci_high:+.3f}], "
                f"n = {diff.n}" if diff else ""),
             f"- sign-flip p = {d.p_value if d.p_value is not None else nan:.4g} (Holm over {d.family}: "
             f"{d.p_adjusted if d.p_adjusted is not None else '-'})"
             + (f"; McNemar on the decisions p = {m.p_value:.4g} (b = {m.b}, c = {m.c}, n = {m.n})"
                if diff and (m := diff.decision) else "")]
    if d.auc:
        lines.append(f"- AUC of P(GO): {d.auc}")
    lines.append(f"- the gate: {d.rule}: {d.detail}")
    if d.run_url:
        lines.append(f"- evaluation run: {d.run_url}")
    return "\n".join(lines)


def _write(result: PromotionReport) -> None:
    doc = result.model_dump(mode="json")
    write_json(METRICS_FILE, doc)
    metrics_files.write("promote", doc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    answer = parser.add_mutually_exclusive_group()
    answer.add_argument("--approve", metavar="KEY", help="switch in the candidate KEY (as in reports/promotion.json) that "
                        "awaits approval, through the same switch a promotion takes")
    answer.add_argument("--reject", metavar="KEY", help="refuse it: not_approved, nothing switched")
    parser.add_argument("--by", default=os.environ.get("USER", "cli"), help="who answers (recorded on the version)")
    parser.add_argument("--why", default="", help="the answer's reason (recorded on the version and in the journal)")


def check(args: argparse.Namespace, params: Params) -> None:
    """An answer to a candidate that is not awaiting one, refused from the cycle's report before the serving stack and
    MLflow start (the CLI calls this first)."""
    if (key := _answered(args)) is not None:
        _awaiting(key, Status.PROMOTED if args.approve is not None else Status.NOT_APPROVED)


def _answered(args: argparse.Namespace) -> str | None:
    """The key a person answers (``--approve KEY`` / ``--reject KEY``); an empty one is still an answer, never a run of
    the whole gate (``--approve "$KEY"`` with KEY unset)."""
    return args.approve if args.approve is not None else args.reject


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)  # reconciles a switch a crash interrupted before anything else
    if (key := _answered(args)) is not None:
        approve = args.approve is not None
        try:
            with tracking.stage_run("promote", params.mlflow):
                settle(params, key, approve, args.by, args.why or ("approved" if approve else "rejected"))
        except PromotionError as exc:
            print(f"error: {exc}; champion alias and live routing unchanged", file=sys.stderr)
            return 1
        return 0
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

