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

from pipeline import metrics_files, prompt_registry, tracking
from pipeline.agents import decision
from pipeline.agents.llm import RoleClient
from pipeline.agents.prompts import Prompts
from pipeline.agents.replay import CallBook
from pipeline.config import DecisionInput, EvaluateParams, Params
from pipeline.contracts import Level, Metrics, PromotionReport
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
    return PromotionReport.model_validate_json(PROMOTION_FILE.read_text()).replaced(role)


# whole Params: the role's requests read agents, reward, data, pi, serving, evaluate and report
def role_level_report(params: Params, role: str, prompts: Prompts) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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
    out: dict[str, Any] = {"questions": len(tasks), "setting": params.data.setting, "maybe_answer": "DEFER",
                           "champion": champion.version if champion else None, "previous_champion": before,
                           **{w: s["metrics"].model_dump(exclude_unset=True) for w, s in scored.items()},
                           "seconds": {w: s["seconds"] for w, s in scored.items()}}
    if "before" in scored:
        out.update(_after_better(scored["after"]["records"], scored["before"]["records"]))
    print(_role_line(role, out, scored["after"]["metrics"], scored.get("before", {}).get("metrics"), params.data.setting))
    return out, scored["after"]["records"]


def _after_better(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact McNemar on the yes/no questions both answered: is the new champion right more often than the one it replaced?"""
    a, b = ({r["task_id"]: r for r in records} for records in (after, before))
    yes_no = [t for t in sorted(a) if a[t]["label"] in ("yes", "no")]
    right = lambda r: answer(r["decision"]) == r["label"]  # noqa: E731
    test = mcnemar_exact([right(a[t]) for t in yes_no], [right(b[t]) for t in yes_no], "greater")
    return {"mcnemar_p": test.p_value,
            "mcnemar": {**test.model_dump(exclude_unset=True), "alternative": "after better than before"}}


def _role_line(role: str, out: dict[str, Any], after: Metrics, before: Metrics | None, setting: str) -> str:
    assert after.official and after.yes_no and after.auc  # role_level.metrics sets them at the role level
    line = (f"report: {role} v{out['champion']} on {out['questions']} test questions ({setting}): official accuracy "
            f"{after.official.accuracy:.3f}, macro-F1 {after.official.macro_f1:.3f}; yes/no accuracy "
            f"{after.yes_no.accuracy:.3f} [{after.yes_no.ci_low:.3f}, {after.yes_no.ci_high:.3f}] "
            f"(n={after.yes_no.n}, majority {after.yes_no.majority:.3f}), AUC {after.auc}")
    if before is not None:
        assert before.yes_no and before.auc
        line += (f"; before (v{out['previous_champion']}): yes/no accuracy {before.yes_no.accuracy:.3f}, AUC "
                 f"{before.auc}; exact McNemar (after > before) p={out['mcnemar_p']:.2e}")
    return line


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


def _paired(after: list[dict[str, Any]], before: list[dict[str, Any]], evaluate: EvaluateParams) -> dict[str, Any]:
    """The society after vs before on the same questions: the paired reward difference, the exact McNemar test on yes/no
    correctness (``paired_difference``'s) and on failures."""
    reward = paired_difference(after, before, evaluate.bootstrap, evaluate.ci, evaluate.seed)
    a, b = {r["task_id"]: r for r in after}, {r["task_id"]: r for r in before}
    ok = lambda r: r["status"] == "ok"  # noqa: E731
    served = mcnemar_exact([ok(a[t]) for t in sorted(a)], [ok(b[t]) for t in sorted(a)])
    return {"correct": reward.decision.model_dump() if reward.decision else None,
            "reward": reward.model_dump(exclude={"decision"}), "served": served.model_dump(exclude_unset=True)}


def _agreement(records: list[dict[str, Any]], role_records: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """How often the society's decision is the role-level decision of the same champion on the same question."""
    if not role_records:
        return None
    by_id = {r["task_id"]: r["decision"] for r in role_records}
    both = [r for r in records if r["task_id"] in by_id]
    same = sum(r["decision"] == by_id[r["task_id"]] for r in both)
    return {"n": len(both), "same": same, "rate": same / len(both) if both else None}


# whole Params: the PI's calls read agents, data, serving and evaluate
def input_effect(params: Params, traces: list[Trace], tasks: list[dict[str, Any]], role: str, prompts: Prompts,
                 routing_name: str | None = None) -> dict[str, Any]:
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
    return {**_effect(rows), "served_input": served.value}


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
                   prompts: Prompts) -> dict[str, Any]:
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
    out: dict[str, Any] = {"questions": len(tasks), "after": after, "records": after_records, "traces": traces[0],
                           "agreement_with_role_level": _agreement(after_records, role_records),
                           "cost": {"seconds": seconds, "societies": len(societies),
                                    "seconds_per_question": seconds / max(len(tasks), 1)}}
    if len(traces) > 1:
        out["before"], before_records = _society_figures(traces[1], params.evaluate, params.data.setting)
        out["before_version"] = before
        out["after_vs_before"] = _paired(after_records, before_records, params.evaluate)
    if role:
        out["input_effect"] = input_effect(params, traces[0], tasks, role, prompts)
    return out


def _line(which: str, m: Metrics) -> str:
    assert m.official and m.yes_no and m.failures  # role_level.metrics sets them
    return (f"{which}: official accuracy {m.official.accuracy:.3f}, macro-F1 {m.official.macro_f1:.3f} "
            f"(n={m.questions}); yes/no {m.yes_no.accuracy:.3f} [{m.yes_no.ci_low:.3f}, {m.yes_no.ci_high:.3f}] "
            f"(n={m.yes_no.n}); failed {m.failures.n}/{m.questions}")


def run(params: Params, prompts: Prompts) -> dict[str, Any]:
    """The role-level readout on the test split (every decision role), then the society as served (rendering
    ``prompts``, the live routing's); PubMedQA's files from the figure ``report.predictions`` names, both figures logged
    under names that cannot be confused."""
    role_results: dict[str, Any] = {}
    role_records: dict[str, list[dict[str, Any]]] = {}
    decision_roles = [r for r in params.evaluate.role_level if r in params.promote.roles]
    if params.report.role_level:
        for role in decision_roles:
            role_results[role], role_records[role] = role_level_report(params, role, prompts)
    pi = decision_roles[0] if decision_roles else None
    served = society_report(params, pi, role_records.get(pi) if pi else None, prompts)
    records, after, traces = served.pop("records"), served["after"], served.pop("traces")
    society_json = _written(served)
    figures = society_json["after"]
    rows = next(iter(role_records.values())) if params.report.predictions == "role_level" and role_records else None
    predictions, truth, official = _official(traces, records, rows)
    pmids = list(truth)
    with atomic_dir(params.report.out_dir) as tmp:
        (tmp / "predictions.json").write_text(json.dumps(predictions, indent=1))
        (tmp / "ground_truth.json").write_text(json.dumps(truth, indent=1))
        (tmp / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        for role, rows in role_records.items():
            (tmp / f"{role}-records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    live = routing.active(params.serving)
    result = {"questions": len(pmids), "setting": params.data.setting, "routing_version": live["version"] if live else None,
              "predictions": params.report.predictions, "official": official, "society": society_json,
              **{k: figures[k] for k in ("reward", "success_rate", *CRITERIA, "turns", "tokens", "latency_s") if k in figures},
              "role_level": role_results}
    _log(params.report.out_dir, after, official, role_results)
    _print(params, served, official, len(pmids))
    return result


def _written(served: dict[str, Any]) -> dict[str, Any]:
    """The society's figures as ``reports/test.json`` holds them: each side's ``Metrics`` as its JSON."""
    return {k: v.model_dump(exclude_unset=True) if isinstance(v, Metrics) else v for k, v in served.items()}


def _official(traces: list[Trace], records: list[dict[str, Any]],
              role_rows: list[dict[str, Any]] | None) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """PubMedQA's files (PMID -> yes/no/maybe) and its official figures: from the role-level PI's answers to every
    question (``role_rows``), else from the society's decisions."""
    if role_rows is not None:
        predictions = {r["task_id"]: answer(r["decision"]) for r in role_rows}
        truth = {r["task_id"]: r["label"] for r in role_rows}
    else:
        predictions, truth = {t.task_id: answer(t.decision) for t in traces}, {r["task_id"]: r["label"] for r in records}
    pmids = list(truth)
    return predictions, truth, {"accuracy": sum(predictions[p] == truth[p] for p in pmids) / len(pmids),
                                "macro_f1": macro_f1([truth[p] for p in pmids], [predictions[p] for p in pmids])}


def _log(out_dir: str, after: Metrics, official: dict[str, Any], role_results: dict[str, Any]) -> None:
    """Two names that cannot be confused: test.society.* is the society as served, test.role_level.<role>.* the readout,
    test.predictions.* what predictions.json scores."""
    assert after.official and after.failures and after.questions is not None  # role_level.metrics sets them
    mlflow.log_metrics({**{f"test.society.{k}": v for k, v in flat(after.model_dump(exclude_unset=True)).items()},
                        "test.society.official_accuracy": after.official.accuracy,
                        "test.society.official_macro_f1": after.official.macro_f1,
                        "test.society.failure_rate": after.failures.rate, "test.society.n": after.questions,
                        **{f"test.predictions.{k}": v for k, v in official.items()},
                        **{f"test.role_level.{role}.{k}": v for role, x in role_results.items()
                           for k, v in flat(x["after"]).items() if v == v}})
    mlflow.log_artifacts(out_dir, artifact_path="test")


# whole Params: report's out_dir and predictions beside the served figures
def _print(params: Params, served: dict[str, Any], official: dict[str, Any], n: int) -> None:
    print(f"report: society as served, {_line('after', served['after'])}")
    if "before" in served:
        was = f"before (v{served['before_version']})"
        print(f"report: society as served, {_line(was, served['before'])}; exact "
              f"McNemar after vs before p={served['after_vs_before']['correct']['p_value']:.3g}")
    if (agree := served.get("agreement_with_role_level")) and agree["n"]:
        print(f"report: the society's decision is the role-level decision on {agree['same']}/{agree['n']} questions")
    print(f"report: predictions.json ({params.report.predictions}) on {n} test questions: accuracy "
          f"{official['accuracy']:.3f}, macro-F1 {official['macro_f1']:.3f} (PubMedQA's evaluation.py: python "
          f"evaluation.py {params.report.out_dir}/predictions.json with data/test_ground_truth.json = "
          f"{params.report.out_dir}/ground_truth.json)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)
    rendered = prompt_registry.sync(params.mlflow, routing.active(params.serving))  # the routed prompt versions
    with tracking.stage_run("report", params.mlflow):
        try:
            result = run(params, rendered)
        finally:
            routing.drop_evals()  # the replaced champion's tables end with the report
    write_json(METRICS_FILE, result)
    metrics_files.write("report", result)
    return 0
