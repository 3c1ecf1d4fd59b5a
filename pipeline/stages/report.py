"""The champions on PubMedQA's official test split: the numbers people quote, each named for what it measures.

Two figures, never confused (``reports/test.json`` and MLflow ``test.society.*`` / ``test.role_level.<role>.*``):

- **the society as served** (``society``): the whole society through the live routing, one rollout per question with
  the judge, on ``report.limit`` questions; a failed rollout decides nothing (it counts wrong, answers ``maybe`` in
  PubMedQA's format, and the failure rate stands beside the accuracy). When this cycle promoted the decision role, the
  society with the champion it replaced runs on the same questions, replaying the first society's other calls (the PI
  speaks last), and the two are compared by exact McNemar; how often the society's decision is the role-level one,
  and what the protocol and the reviews do to the decision (:func:`input_effect`), are reported with their n.
- **the role level** (``role_level``): the decision role's own decision on ``report.role_limit`` questions (all 500:
  the literature's figure), the same call the society's PI makes (``pipeline.agents.decision``).

The test split is read here and nowhere else: no training, evaluation or gating stage has it among its DVC deps
(tests/test_dvc_pipeline.py checks). Predictions (``report.predictions``: society or role_level) are written in
PubMedQA's own format (PMID -> yes/no/maybe) next to the ground truth of the same PMIDs, so the official
``evaluation.py`` scores a limited CPU run too; accuracy and macro-F1 are computed the way that script does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import mlflow

from pipeline import contracts, metrics_files, prompt_registry, tracking
from pipeline.agents import decision
from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import Prompts
from pipeline.agents.replay import CallBook
from pipeline.config import DecisionInput, EvaluateParams, Params
from pipeline.contracts import Level, McNemar, Metrics, Official, PromotionReport, RoleLevelFigures, TestReport
from pipeline.data.splits import load_tasks
from pipeline.evaluation import role_level, society
from pipeline.evaluation.metrics import CRITERIA, answer, flat, macro_f1, paired_difference
from pipeline.evaluation.significance import mcnemar_exact
from pipeline.io import atomic_dir, write_json
from pipeline.progress import bars
from pipeline.schemas import Decision
from pipeline.serving import deploy, proxy, routing, stack
from pipeline.traces.schema import Trace

METRICS_FILE = Path("reports/test.json")
PROMOTION_FILE = Path("reports/promotion.json")  # promote's record: which champion this cycle replaced


def _previous_champion(role: str) -> str | None:
    """The version this cycle's promotion replaced for ``role`` (None: no promotion this cycle)."""
    if not PROMOTION_FILE.exists():
        return None
    return contracts.read(PromotionReport, PROMOTION_FILE).replaced(role)


# whole Params: the role's requests read agents, reward, data, pi, serving, evaluate and report
def role_level_report(params: Params, role: str, prompts: Prompts) -> tuple[RoleLevelFigures, list[dict[str, Any]]]:
    """``role``'s champion on its own decision over the test split (report.role_limit questions), and, when this cycle
    promoted it, the champion it replaced on the same questions: exact McNemar on the yes/no questions, both AUCs."""
    from pipeline import registry  # noqa: PLC0415 - control plane registry; only this report needs it here

    tasks = load_tasks(params.validate_, "test", params.report.role_limit, setting=params.data.setting)
    url, key = proxy.client_settings(params.serving)
    cfg = params.evaluate
    before = _previous_champion(role)
    tables: dict[str, str | None] = {"after": None}
    if before is not None:  # the replaced champion, reached through an evaluation table (the live one is untouched)
        tables["before"] = _replaced_table(params, role, before, routing.active(params.serving) or {},
                                           f"test-{role}-v{before}")
    scored: dict[str, Any] = {}
    for which, table in tables.items():
        t0 = time.perf_counter()
        with bars() as new:
            records = asyncio.run(role_level.decide(url, key, role, tasks, params.agents, params.reward, params.data.setting,
                                                    cfg.role_concurrency, cfg.timeout_s, prompts, table,
                                                    progress=new(f"report: {role} ({which}) on the test split", len(tasks))))
        scored[which] = {"records": records, "seconds": time.perf_counter() - t0,
                         "metrics": role_level.metrics(records, params.data.setting, cfg.bootstrap, cfg.ci, cfg.seed)}
    champion = registry.by_alias(role, registry.CHAMPION)
    test = _after_better(scored["after"]["records"], scored["before"]["records"]) if "before" in scored else None
    return RoleLevelFigures(questions=len(tasks), setting=params.data.setting, maybe_answer="DEFER",
                            champion=champion.version if champion else None, previous_champion=before,
                            after=scored["after"]["metrics"], before=scored.get("before", {}).get("metrics"),
                            seconds={w: s["seconds"] for w, s in scored.items()},
                            mcnemar_p=test.p_value if test else None, mcnemar=test), scored["after"]["records"]


def _after_better(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> McNemar:
    """Exact McNemar on the yes/no questions both answered: is the new champion right more often than the one it replaced?"""
    a, b = ({r["task_id"]: r for r in records} for records in (after, before))
    yes_no = [t for t in sorted(a) if a[t]["label"] in ("yes", "no")]
    right = lambda r: answer(r["decision"]) == r["label"]  # noqa: E731
    test = mcnemar_exact([right(a[t]) for t in yes_no], [right(b[t]) for t in yes_no], "greater")
    return McNemar.model_validate({**test.model_dump(exclude_unset=True), "alternative": "after better than before"})


# whole Params: deploying a version reads serving and the registry's tracking settings
def _replaced_table(params: Params, role: str, version: str, live: dict[str, Any], name: str) -> str:
    """An evaluation routing table with ``role`` on the ``version`` this cycle replaced (the live one is untouched)."""
    from pipeline import registry  # noqa: PLC0415 - control plane registry; only this report needs it here

    where = deploy.deploy(params.serving, role, registry.get_version(role, version), live["roles"].get(role))
    routing.write_eval(params.serving, name, {**live["roles"], role: where}, live.get("policies"))
    return name


def _society_figures(traces: list[Trace], evaluate: EvaluateParams, setting: str) -> tuple[Metrics, list[dict[str, Any]]]:
    """What one society served on the test questions (``role_level.metrics`` at the society level: a failure answers
    maybe and counts wrong on yes/no), and each rollout's reward as evaluation reads it (a failed one: the failure score
    with its decision credit)."""
    records: list[dict[str, Any]] = [
               {"task_id": t.task_id, "label": t.label, "decision": t.decision, "status": t.status, "error": t.error,
                "reward": t.final()["value"], "scores": t.rewards,
                "turns": t.turns, "tokens": t.tokens, "latency_s": t.latency_s} for t in traces]
    return role_level.metrics(records, setting, evaluate.bootstrap, evaluate.ci, evaluate.seed, Level.SOCIETY), records


def _paired(after: list[dict[str, Any]], before: list[dict[str, Any]], evaluate: EvaluateParams) -> contracts.SocietyPaired:
    """The society after vs before on the same questions: the paired reward difference, the exact McNemar test on yes/no
    correctness (``paired_difference``'s) and on failures."""
    reward = paired_difference(after, before, evaluate.bootstrap, evaluate.ci, evaluate.seed)
    a, b = {r["task_id"]: r for r in after}, {r["task_id"]: r for r in before}
    ok = lambda r: r["status"] == "ok"  # noqa: E731
    served = mcnemar_exact([ok(a[t]) for t in sorted(a)], [ok(b[t]) for t in sorted(a)])
    return contracts.SocietyPaired(correct=reward.decision, reward=reward.model_copy(update={"decision": None}), served=served)


def _agreement(records: list[dict[str, Any]], role_records: list[dict[str, Any]] | None) -> contracts.Agreement | None:
    """How often the society's decision is the role-level decision of the same champion on the same question."""
    if not role_records:
        return None
    by_id = {r["task_id"]: r["decision"] for r in role_records}
    both = [r for r in records if r["task_id"] in by_id]
    same = sum(r["decision"] == by_id[r["task_id"]] for r in both)
    return contracts.Agreement(n=len(both), same=same, rate=same / len(both) if both else None)


# whole Params: the PI's calls read agents, data, serving and evaluate
def input_effect(params: Params, traces: list[Trace], tasks: list[dict[str, Any]], role: str, prompts: Prompts,
                 routing_name: str | None = None) -> contracts.InputEffect:
    """What the protocol and the reviews do to the decision: for every rollout whose PI answered, the same weights'
    decision on the brief alone and on the brief with the society's protocol and reviews, yes/no accuracy of each and
    how often they agree (docs/promotion.md). The society served one of the two (``agents.decision.input``): that one is
    its recorded decision, and only the other is asked."""
    served, by_id = params.agents.decision.input, {t["id"]: t for t in tasks}
    asked = [a for t in traces if (a := _asked(t, role)) is not None]
    url, key = proxy.client_settings(params.serving)

    def other(t: Trace, explained: dict[str, Any]) -> list[dict[str, str]]:
        if served == DecisionInput.BRIEF:  # the rationale's request read the protocol and reviews: its chat, unanswered
            return explained["messages"][:-1]
        return decision.decision_messages(by_id[t.task_id], params.agents, params.data.setting, prompts,
                                          what=DecisionInput.BRIEF)

    async def ask_all() -> list[Decision | None]:
        client = RoleClient.for_agents(params.agents, url, key, params.evaluate.timeout_s, routing=routing_name)
        sem = asyncio.Semaphore(params.evaluate.role_concurrency)

        async def one(t: Trace, explained: dict[str, Any]) -> Decision | None:
            async with sem:
                return (await decision.ask(client, role, role, params.agents.decision, other(t, explained), None, [])).decision

        try:
            return list(await asyncio.gather(*(one(t, e) for t, _, e in asked)))
        finally:
            await client.aclose()

    rows: list[tuple[str | None, str | None, str | None]] = []
    for (t, decided, _), answered in zip(asked, asyncio.run(ask_all()) if asked else [], strict=True):
        recorded, asked_now = decided.get("decision"), answered.value if answered else None
        rows.append((t.label, *((recorded, asked_now) if served == DecisionInput.BRIEF else (asked_now, recorded))))
    return contracts.InputEffect.model_validate({**_effect(rows), "served_input": served.value})


def _asked(t: Trace, role: str) -> tuple[Trace, dict[str, Any], dict[str, Any]] | None:
    """A rollout's PI spans that asked the decision and the rationale (brief, protocol and reviews)."""
    pi = [s.data for s in t.spans if s.kind == "llm" and s.data.get("logical_model") == role and s.data.get("ok")]
    decided = next((d for d in pi if d.get("step") == "decision"), None)
    explained = next((d for d in pi if d.get("step") == "rationale"), None)
    return (t, decided, explained) if decided and explained else None


def _effect(rows: list[tuple[str | None, str | None, str | None]]) -> dict[str, Any]:
    """(label, decision on the brief, decision with the protocol and reviews): accuracy of each, agreement, McNemar."""
    yes_no = [r for r in rows if r[0] in ("yes", "no")]
    right = lambda label, d: answer(d) == label  # noqa: E731
    test = mcnemar_exact([right(lab, b) for lab, _, b in yes_no], [right(lab, a) for lab, a, _ in yes_no])
    return {"n": len(rows), "agree": sum(a == b for _, a, b in rows), "yes_no_n": len(yes_no),
            "brief_accuracy": sum(right(lab, a) for lab, a, _ in yes_no) / max(len(yes_no), 1),
            "society_accuracy": sum(right(lab, b) for lab, _, b in yes_no) / max(len(yes_no), 1),
            "mcnemar": {**test.model_dump(exclude_unset=True),
                        "b_means": "right with the protocol and reviews, wrong on the brief alone"}}


# whole Params: running the society reads six sections (see evaluation.society.run_many)
def society_report(params: Params, role: str | None, role_records: list[dict[str, Any]] | None,
                   prompts: Prompts) -> tuple[contracts.SocietyFigures, list[dict[str, Any]], list[Trace]]:
    """The society as served on ``report.limit`` test questions, and, when this cycle promoted ``role``, the society
    with the champion it replaced on the same questions. The second society replays the first's calls of every other
    role (the same upstream answers: the PI is the last to speak), so before/after costs one society pass plus the
    replaced PI's own calls."""
    tasks = load_tasks(params.validate_, "test", params.report.limit, setting=params.data.setting)
    live = routing.active(params.serving)
    societies: list[tuple[dict[str, Any] | None, str | None]] = [(live, None)]
    books: list[CallBook | None] = [None]
    before = _previous_champion(role) if role else None
    if role and before is not None and live is not None:
        name = _replaced_table(params, role, before, live, f"test-society-{role}-v{before}")
        societies.append(({**live, "version": f"eval:{name}"}, name))
        books = [shared := CallBook(), shared.sharing([role])]  # the PI speaks last: the before society shares the rest
    t0 = time.perf_counter()
    traces = society.run_many(params, tasks, societies, tracking.pipeline_run_id(), prompts, score=True,
                              description="report: the society on the test split",
                              books=books)
    seconds = time.perf_counter() - t0
    after, after_records = _society_figures(traces[0], params.evaluate, params.data.setting)
    out = contracts.SocietyFigures(
        questions=len(tasks), after=after, agreement_with_role_level=_agreement(after_records, role_records),
        cost=contracts.SocietyCost(seconds=seconds, societies=len(societies), seconds_per_question=seconds / max(len(tasks), 1)),
        input_effect=input_effect(params, traces[0], tasks, role, prompts) if role else None)
    if len(traces) > 1:
        out.before, before_records = _society_figures(traces[1], params.evaluate, params.data.setting)
        out.before_version = before
        out.after_vs_before = _paired(after_records, before_records, params.evaluate)
    return out, after_records, traces[0]


def run(params: Params, prompts: Prompts) -> TestReport:
    """The role-level readout on the test split (every decision role), then the society as served (rendering
    ``prompts``, the live routing's); PubMedQA's files from the figure ``report.predictions`` names, both figures logged
    under names that cannot be confused."""
    role_results: dict[str, RoleLevelFigures] = {}
    role_records: dict[str, list[dict[str, Any]]] = {}
    decision_roles = [r for r in params.evaluate.role_level if r in params.promote.roles]
    if params.report.role_level:
        for role in decision_roles:
            role_results[role], role_records[role] = role_level_report(params, role, prompts)
    pi = decision_roles[0] if decision_roles else None
    served, records, traces = society_report(params, pi, role_records.get(pi) if pi else None, prompts)
    rows = next(iter(role_records.values())) if params.report.predictions == "role_level" and role_records else None
    predictions, truth, official = _official(traces, records, rows)
    pmids = list(truth)
    _write(params.report.out_dir, {"predictions.json": predictions, "ground_truth.json": truth},
           {"records.jsonl": records, **{f"{role}-records.jsonl": rows for role, rows in role_records.items()}})
    live = routing.active(params.serving)
    figures = served.after.model_dump(exclude_unset=True)  # the society's headline figures, at the top as before
    result = TestReport.model_validate({
        **{k: figures[k] for k in ("reward", "success_rate", *CRITERIA, "turns", "tokens", "latency_s") if k in figures},
        "questions": len(pmids), "setting": params.data.setting, "routing_version": live["version"] if live else None,
        "predictions": params.report.predictions, "official": official, "society": served, "role_level": role_results})
    _log(params.report.out_dir, result)
    print("\n".join(result.lines(params.report.out_dir)))
    return result


def _write(out_dir: str, docs: dict[str, dict[str, str]], rows: dict[str, list[dict[str, Any]]]) -> None:
    """``out_dir`` replaced whole: PubMedQA's files and each answer's record (a failed report leaves the last one)."""
    with atomic_dir(out_dir) as tmp:
        for name, doc in docs.items():
            (tmp / name).write_text(json.dumps(doc, indent=1))
        for name, records in rows.items():
            (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def _official(traces: list[Trace], records: list[dict[str, Any]],
              role_rows: list[dict[str, Any]] | None) -> tuple[dict[str, str], dict[str, str], Official]:
    """PubMedQA's files (PMID -> yes/no/maybe) and its official figures: from the role-level PI's answers to every
    question (``role_rows``), else from the society's decisions."""
    if role_rows is not None:
        predictions = {r["task_id"]: answer(r["decision"]) for r in role_rows}
        truth = {r["task_id"]: r["label"] for r in role_rows}
    else:
        predictions, truth = {t.task_id: answer(t.decision) for t in traces}, {r["task_id"]: r["label"] for r in records}
    pmids = list(truth)
    return predictions, truth, Official(accuracy=sum(predictions[p] == truth[p] for p in pmids) / len(pmids),
                                        macro_f1=macro_f1([truth[p] for p in pmids], [predictions[p] for p in pmids]))


def _log(out_dir: str, report: TestReport) -> None:
    """Two names that cannot be confused: test.society.* is the society as served, test.role_level.<role>.* the readout,
    test.predictions.* what predictions.json scores."""
    after = report.society.after
    assert after.official and after.failures and after.questions is not None  # role_level.metrics sets them
    mlflow.log_metrics({**{f"test.society.{k}": v for k, v in flat(after.model_dump(exclude_unset=True)).items()},
                        "test.society.official_accuracy": after.official.accuracy,
                        "test.society.official_macro_f1": after.official.macro_f1,
                        "test.society.failure_rate": after.failures.rate, "test.society.n": after.questions,
                        **{f"test.predictions.{k}": v for k, v in report.official.model_dump().items()},
                        **{f"test.role_level.{role}.{k}": v for role, x in report.role_level.items()
                           for k, v in flat(x.after.model_dump(exclude_unset=True)).items() if v == v}})
    mlflow.log_artifacts(out_dir, artifact_path="test")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--summary", action="store_true", help="print what the last cycle decided (reports/promotion.json) "
                        "and measured here (reports/test.json); runs nothing, needs no service")


def TRACKING(args: argparse.Namespace) -> bool:  # the CLI's per-module switch (cli.tracks): --summary reads files only
    return not args.summary


def summary(out_dir: str) -> list[str]:
    """The gate's decisions, then the test split's figures, read through their contracts; a file not written is skipped."""
    lines = contracts.read(PromotionReport, PROMOTION_FILE).lines() if PROMOTION_FILE.exists() else []
    if METRICS_FILE.exists():
        lines += contracts.read(TestReport, METRICS_FILE).lines(out_dir)
    return lines


def main(args: argparse.Namespace, params: Params) -> int:
    if args.summary:
        print("\n".join(summary(params.report.out_dir)))
        return 0
    stack.ensure(params.serving, params.mlflow)
    rendered = prompt_registry.sync(params.mlflow, routing.active(params.serving))  # the routed prompt versions
    with tracking.stage_run("report", params.mlflow):
        try:
            result = run(params, rendered)
        finally:
            routing.drop_evals()  # the replaced champion's tables end with the report
    written = result.model_dump(mode="json", exclude_unset=True)
    write_json(METRICS_FILE, written)
    metrics_files.write("report", written)
    return 0
