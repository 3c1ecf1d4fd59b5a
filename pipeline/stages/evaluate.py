"""Evaluate each role's ``challenger`` against its ``champion`` on the validation split.

For every role in ``promote.roles`` whose ``challenger`` alias names a version other than the
``champion``, the whole society runs on the same validation tasks (``evaluate.limit``, one rollout
per task, exploration seed ``evaluate.seed``) twice: with the champions everywhere, and with the
candidate routed in for its role. Both go through *evaluation routing tables* that requests name
in their metadata; the live routing is never touched. The judge runs as a scorer of
``mlflow.genai.evaluate`` over the society's own MLflow traces, so every question's trace and
its scores sit together in the MLflow UI; the scores are read back from that evaluation.

A society evaluation smaller than ``promote.min_tasks`` paired tasks cannot support a decision (the gate's
``insufficient_evidence`` rule), so it is not run: such a candidate is listed under ``unevaluated`` with the reason, and
``promote`` records it as ``insufficient_evidence`` (a CPU default cycle saved 7 min that way). Role-level candidates
answer every validation question and are always evaluated.

The champion's evaluation is cached: a finished evaluation run tagged with the same key (champion
versions, their targets, evaluation/agent/judge/reward params, validation data and index hashes) is
reused instead of run again.

Outputs: ``<evaluate.out_dir>/summary.json`` (per role: both evaluations, the paired
candidate-champion difference with its CI), ``records/*.jsonl`` and ``predictions/*.json``
(PubMedQA's PMID -> yes/no/maybe format); ``reports/evaluate.json``
(DVC metrics); the per-criterion chart ``reports/plots/evaluate.png``; tags ``eval.*`` on the
versions.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Feedback
from mlflow.genai.scorers import scorer

from pipeline import metrics_files, prompt_registry, registry, timing, tracking
from pipeline.agents.graph import OPENING_AGENTS
from pipeline.agents.prompts import Prompts
from pipeline.agents.replay import CallBook
from pipeline.config import EvaluateParams, MlflowParams, Params, PromoteParams, PromptParams, ServingParams
from pipeline.contracts import Difference, EvaluationSummary, Level, Metrics, RoutingTable
from pipeline.data.splits import load_tasks, split_file
from pipeline.envs import REPO_ROOT
from pipeline.evaluation import role_level, society
from pipeline.evaluation.gate import enough_tasks
from pipeline.evaluation.metrics import CRITERIA, answer, flat, paired_difference, summarise
from pipeline.evaluation.served import check_served
from pipeline.io import atomic_dir, write_json, write_text
from pipeline.learning import PROMPT_ALIAS, role_of
from pipeline.lineage import dvc_md5
from pipeline.plots import png
from pipeline.progress import bars
from pipeline.serving import deploy, proxy, routing, stack
from pipeline.traces.mlflow_traces import log_traces
from pipeline.traces.schema import Trace
from pipeline.versions import Line

METRICS_FILE = Path("reports/evaluate.json")
PLOT = Path("reports/plots/evaluate.png")
PLOT_CSV = Path("reports/plots/evaluate.csv")  # the same bars for `dvc plots`


def champion_table(serving: ServingParams, promote: PromoteParams,
                   champions: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Routing roles and policies with every trainable role on its champion (others as live)."""
    live = routing.active(serving) or routing.load_version(serving, routing.versions(serving)[-1])
    roles, policies = dict(live["roles"]), dict(live.get("policies", {}))
    for name in promote.roles:
        table = Line(name).routed(serving, {"roles": roles, "policies": policies}, champions[name])
        roles, policies = table.roles, table.policies
    return roles, policies


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:80]


SCORING_CODE = ("pipeline/agents", "pipeline/rewards", "pipeline/evaluation", "pipeline/schemas.py", "pipeline/traces",
                "pipeline/bandit")


def code_sha256(paths: tuple[str, ...] = SCORING_CODE) -> str:
    """sha256 of the Python source that runs and scores a society (prompts, graph, schemas, judge, rewards)."""
    h = hashlib.sha256()
    for rel in paths:
        root = REPO_ROOT / rel
        for f in sorted([root] if root.is_file() else root.rglob("*.py")):
            h.update(f"{f.relative_to(REPO_ROOT).as_posix()}\0".encode() + f.read_bytes() + b"\n")
    return h.hexdigest()


def served_models(serving: ServingParams) -> dict[str, Any]:
    """Each worker's settings and, for a model folder here, its content hash: the weights a base deployment serves."""
    return {w.name: {**w.model_dump(exclude={"port", "host", "adapter_sync_wait_s", "adapter_store_s3"}),
                     "model_md5": dvc_md5(w.model) if Path(w.model).exists() else None} for w in serving.workers}


# whole Params: the key digests seven of its sections (everything that scores a society).
def cache_key(params: Params, champions: dict[str, Any], roles: dict[str, str], policies: dict[str, str],
              tasks: list[dict[str, Any]], prompts: Prompts) -> str:
    """Everything that decides a champion's scores: a cached champion evaluation is reused only when all of it is equal
    (versions and routing targets, whose LoRA names carry their sha256; the prompt texts the society renders; the
    served base weights and worker settings; the code of the society, judge and schemas; the agents', judge's,
    reward's and evaluation's params; the tasks)."""
    doc = {"champions": {k: v.version for k, v in champions.items()},
           "prompts": {name: prompts.sha(name) for name in sorted(prompts.texts)},
           "champion_sha256": {k: v.tags.get("sha256") for k, v in champions.items()},
           "roles": roles, "policies": policies, "served": served_models(params.serving), "code": code_sha256(),
           "evaluate": params.evaluate.model_dump(exclude={"out_dir", "concurrency"}), "agents": params.agents.model_dump(),
           "judge": params.judge.model_dump(), "reward": params.reward.model_dump(),
           "val": dvc_md5(split_file(params.validate_, "val")), "index": dvc_md5(params.rollouts.index_dir),
           "tasks": [t["id"] for t in tasks], "setting": params.data.setting}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _cached(tracking_cfg: MlflowParams, key: str) -> tuple[list[dict[str, Any]], list[Trace]] | None:
    """A finished champion evaluation with this key: its scored records and its traces (which candidates replay)."""
    runs = mlflow.search_runs([tracking.experiment_id(tracking_cfg)],
                              filter_string=f"tags.`eval.key` = '{key}' and attributes.status = 'FINISHED'",
                              output_format="list", max_results=1)
    if not runs:
        return None
    run_id = runs[0].info.run_id
    docs = {}
    for name in ("records", "traces"):
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f"evaluation/{name}.jsonl")
        docs[name] = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print(f"evaluate: champion evaluation reused from run {run_id} (cache key {key})")
    return docs["records"], [Trace.model_validate(t) for t in docs["traces"]]


# whole Params: a criterion a failed rollout has no score for takes the judge's failure score
def _scorers(params: Params, traces: dict[str, Any]) -> list[Any]:
    """The society's judge and the PubMedQA answer check as MLflow scorers. The judge scored each rollout as it ended
    (``run_many(score=True)``: its calls batch with the societies still running); the scorer reads its scores off the
    trace, as the report does."""

    @scorer(name="society_judge")
    def society_judge(inputs: dict[str, Any]) -> list[Feedback]:
        t = traces[inputs["rollout_id"]]
        final = t.final()
        judged = next((s.data for s in t.spans if s.kind == "reward" and s.name == f"judge.{CRITERIA[0]}"), None)
        reason = (judged or final)["reason"]
        return [*(Feedback(name=c, value=t.rewards.get(c, params.judge.failure_score), rationale=reason) for c in CRITERIA),
                *(Feedback(name=f"reward_{k}", value=v, rationale=reason) for k, v in final["components"].items()),
                Feedback(name="reward", value=final["value"], rationale=reason)]

    @scorer(name="pubmedqa_answer")
    def pubmedqa_answer(inputs: dict[str, Any]) -> Feedback:
        t = traces[inputs["rollout_id"]]
        return Feedback(value=answer(t.decision) == t.label,
                        rationale=f"decision {t.decision} -> {answer(t.decision)}; label {t.label}")

    return [society_judge, pubmedqa_answer]


def _stored_trace(trace_id: str, attempts: int = 20) -> Any:
    for _ in range(attempts):
        trace = mlflow.get_trace(trace_id)
        if trace is not None:
            return trace
        time.sleep(0.5)
    raise RuntimeError(f"trace {trace_id} was logged but cannot be read back from the tracking server")


def _table(serving: ServingParams, tracking_cfg: MlflowParams, name: str, roles: dict[str, str],
           policies: dict[str, str]) -> dict[str, Any]:
    """Write an evaluation routing table and check every role answers through it."""
    table = routing.write_eval(serving, name, roles, policies)
    problems = routing.verify(serving, tracking_cfg, table, routing=name)
    if problems:
        raise RuntimeError(f"evaluation routing {name} does not answer: {problems}")
    return table


# whole Params: it builds the judge's scorers (see _scorers).
def score(params: Params, name: str, table: dict[str, Any], traces: list[Any],
          tags: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    """Score one society's rollouts with MLflow's GenAI evaluation as a nested run; returns (records, run id)."""
    by_id = {t.rollout_id: t for t in traces}
    os.environ.setdefault("MLFLOW_GENAI_EVAL_MAX_WORKERS", str(params.evaluate.concurrency))
    with mlflow.start_run(run_name=f"eval {name}", nested=True, tags={"pipeline.kind": "evaluation", **tags}) as run:
        mlflow.log_dict(table, "evaluation/routing.json")
        ids = log_traces([t.model_dump() for t in traces])
        mlflow.flush_trace_async_logging()  # the traces must be stored before the evaluation reads them back
        data = [{"trace": _stored_trace(tid), "expectations": {"label": t.label}} for tid, t in zip(ids, traces, strict=True)]
        result = mlflow.genai.evaluate(data=data, scorers=_scorers(params, by_id))
        if result.result_df is None:
            raise RuntimeError(f"mlflow.genai.evaluate returned no result table for {name}")
        rows = {r["request"]["rollout_id"]: r for r in result.result_df.to_dict("records")}
        records = []
        for t in traces:
            row = rows[t.rollout_id]
            records.append({"task_id": t.task_id, "rollout_id": t.rollout_id, "label": t.label, "decision": t.decision,
                            "status": t.status, "error": t.error, "reward": float(row["reward/value"]),
                            "components": {k: float(row[f"reward_{k}/value"]) for k in ("judge", "decision")},
                            "scores": {c: float(row[f"{c}/value"]) for c in CRITERIA}, "turns": t.turns, "tokens": t.tokens,
                            "latency_s": t.latency_s, "protocol": t.protocol, "trace_id": row["trace_id"]})
        summary = summarise(records, params.evaluate.bootstrap, params.evaluate.ci, params.evaluate.seed)
        mlflow.log_metrics(flat(summary))
        mlflow.log_text("".join(json.dumps(r) + "\n" for r in records), "evaluation/records.jsonl")
        # the calls as answered: a cached champion's traces are what later candidates replay (agents.replay)
        mlflow.log_text("".join(t.model_dump_json() + "\n" for t in traces), "evaluation/traces.jsonl")
    return records, run.info.run_id


def society_cost(traces: list[Any]) -> dict[str, Any]:
    """What one society's evaluation cost: LLM calls sent to a model and answered from the record, per task, and the
    rollouts' summed wall time (a replayed call takes none). docs/benchmarks-learning.md compares replayed and whole."""
    llm = [s for t in traces for s in t.spans if s.kind == "llm" and s.name != "judge"]  # the society's, not its judge's
    replayed = sum(1 for s in llm if s.data.get("replayed"))
    n = max(len(traces), 1)
    return {"tasks": len(traces), "live_calls_per_task": (len(llm) - replayed) / n, "replayed_calls_per_task": replayed / n,
            "rollout_s_per_task": sum(t.latency_s for t in traces) / n}


def plot(summary: EvaluationSummary) -> None:
    bars: dict[str, list[float]] = {}
    columns = (*CRITERIA, "reward")
    for role, entry in summary.roles.items():
        bars.setdefault(f"champion ({entry.champion.label})", [entry.champion.metrics.mean(c) for c in columns])
        bars[f"{role} v{entry.candidate.version}"] = [entry.candidate.metrics.mean(c) for c in columns]
    # one bar per criterion and society, named by role (not version) so `dvc plots diff` lines cycles up
    by_society = dict(zip(["champion", *summary.roles], bars.values(), strict=True)) if bars else {}
    write_text(PLOT_CSV, "bar,criterion,society,mean\n" + "".join(
        f"{c}: {s},{c},{s},{values[i]}\n" for i, c in enumerate(columns) for s, values in by_society.items()))
    with png(PLOT, size=(8, 3.8)) as ax:
        if not bars:
            ax.text(0.5, 0.5, "no candidates this cycle", ha="center", va="center")
            ax.set_axis_off()
            return
        width = 0.8 / max(len(bars), 1)
        for i, (label, values) in enumerate(bars.items()):
            ax.bar([x + i * width for x in range(len(columns))], values, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(columns))], columns, rotation=20)
        ax.set_ylim(0, 1)
        ax.set_title("Validation: judge criteria, champion vs candidates")
        ax.legend(fontsize=7)


@dataclass
class Society:
    """One society to run on the plan's tasks: the champion's (``role`` None), or one with a candidate routed in."""

    slug: str
    table: dict[str, Any]
    tags: dict[str, str]
    role: str | None = None
    version: Any = None
    target: str | None = None


@dataclass
class Plan:
    """What a cycle evaluates, decided before anything runs: the tasks, every role on its champion, the candidates of
    each level, and those too small to decide on (not run)."""

    champions: dict[str, Any]
    tasks: list[dict[str, Any]]
    rotation: str
    roles: dict[str, str]
    policies: dict[str, str]
    key: str
    label: str
    prompts: Prompts  # what every society of the cycle renders: the live routing's prompt versions
    role_level: list[str] = field(default_factory=list)
    societies: list[Society] = field(default_factory=list)
    unevaluated: dict[str, dict[str, Any]] = field(default_factory=dict)


# whole Params: the plan reads promote, evaluate, validate, data, serving and mlflow
def plan(params: Params, prompts: Prompts) -> Plan:
    with timing.phase(timing.Phase.REGISTRY):
        champions = registry.ensure_baselines(params)
    # the cycle = the challengers under evaluation: each cycle draws its own validation tasks (seeded, reproducible)
    evaluated = [n for n in params.promote.roles if params.evaluate.only is None or n in params.evaluate.only]
    challengers = {n: c for n in evaluated
                   if (c := registry.by_alias(n, registry.CHALLENGER)) is not None and c.version != champions[n].version}
    rotation = f"{params.evaluate.seed}:{','.join(f'{n}:v{c.version}' for n, c in challengers.items())}"
    tasks = load_tasks(params.validate_, "val", params.evaluate.limit, rotation=rotation, setting=params.data.setting)
    roles, policies = champion_table(params.serving, params.promote, champions)
    p = Plan(champions, tasks, rotation, roles, policies, cache_key(params, champions, roles, policies, tasks, prompts),
             ",".join(f"{n}:v{v.version}" for n, v in champions.items()), prompts,
             role_level=[n for n in params.evaluate.role_level if n in evaluated])
    for name in (n for n in evaluated if n not in params.evaluate.role_level):
        _add_society(params, p, name, challengers.get(name))
    return p


# whole Params: the role's gate and its candidate society's deployment (_too_few, _candidate)
def _add_society(params: Params, p: Plan, name: str, cand: Any) -> None:
    """A society-level role's challenger into the plan: deployed with its table, or why it is not evaluated."""
    if cand is None:
        print(f"evaluate: {name}: no challenger (champion v{p.champions[name].version})")
    elif (why := _too_few(params, name, len(p.tasks))) is not None:
        p.unevaluated[name] = {"role": name, "alias": registry.CHALLENGER, "version": cand.version, "reason": why}
        print(f"evaluate: {name} v{cand.version}: not evaluated: {why}")
    else:
        p.societies.append(_candidate(params, p, name, cand))


# whole Params: the role's own gate (Params.gate)
def _too_few(params: Params, name: str, n: int) -> str | None:
    """The gate's first rule, applied before a society runs: an evaluation this small cannot support a decision."""
    min_tasks = params.gate(name).min_tasks
    if enough_tasks(n, min_tasks) is None:
        return None
    own = name if name in params.roles else role_of(name)
    source = "promote" if min_tasks == params.promote.min_tasks else f"roles.{own}.gate"
    return (f"{n} validation task(s) (evaluate.limit={params.evaluate.limit}) < {source}.min_tasks={min_tasks}: a society "
            "evaluation this small cannot support a decision, so it was not run")


# whole Params: serving and mlflow
def _candidate(params: Params, p: Plan, name: str, cand: Any) -> Society:
    """The society with ``cand`` routed in for ``name`` (deployed first), every other role on its champion."""
    table = Line(name).routed(params.serving, {"roles": p.roles, "policies": p.policies}, cand)
    slug = _slug(f"{name}-v{cand.version}-{p.key[:8]}")
    return Society(slug, _table(params.serving, params.mlflow, slug, table.roles, table.policies),
                   {"eval.role": name, "eval.version": str(cand.version), "eval.champions": p.label}, name, cand,
                   table.deployment)


Records = dict[str, dict[str, list[dict[str, Any]]]]  # summary key -> champion / candidate -> scored rows


def run(params: Params, prompts: Prompts) -> tuple[EvaluationSummary, Records]:
    """Plan, then each candidate against its champion (role level, then societies): the summary ``promote`` reads, built
    once here, and each pair's scored rows. ``prompts``: what the live routing renders (``prompt_registry.sync``)."""
    p = plan(params, prompts)
    entries: dict[str, Any] = {}
    for name in p.role_level:
        entries.update(evaluate_role(params, name, p))
    if p.societies:
        entries.update(evaluate_societies(params, p))
    records = {key: entry.pop("records") for key, entry in entries.items()}
    summary = EvaluationSummary.model_validate({
        "tasks": [t["id"] for t in p.tasks], "task_rotation": p.rotation, "setting": params.data.setting,
        "champion_versions": {n: v.version for n, v in p.champions.items()},
        "champion_routing": RoutingTable(roles=p.roles, policies=p.policies).model_dump(), "roles": entries,
        "unevaluated": p.unevaluated})
    return summary, records


# whole Params: evaluate, promote and agents
def _replay(params: Params, p: Plan, champion_traces: list[Trace] | None) -> list[CallBook | None]:
    """Each society's call book: a candidate's answers its role's calls live and every other call that repeats the
    champion's from the champion's draw (a cached run's traces, or the champion society running beside it, whose book
    comes first then and shares its draws)."""
    champion = CallBook.from_traces(champion_traces or [])
    books: list[CallBook | None] = []
    for s in p.societies:
        llm = params.promote.roles[str(s.role)] == "llm"
        if not params.evaluate.replay or (llm and s.role in {params.agents.models[a] for a in OPENING_AGENTS}):
            books.append(None)  # the juniors' calls open every rollout: nothing of the champion's comes before them
            continue
        books.append(champion.sharing([str(s.role)] if llm else []))
    shared = champion if any(b is not None for b in books) else None
    return books if champion_traces is not None else [shared, *books]


# whole Params: the societies run with agents, serving and evaluate, and are scored by the judge (see score)
def evaluate_societies(params: Params, p: Plan) -> dict[str, Any]:
    """The champion society (unless a finished run with the same key is cached) and every candidate society on the
    same tasks, in one event loop, scored; summary entries keyed by role."""
    cached = _cached(params.mlflow, p.key)
    champion: list[Society] = []
    if cached is None:
        slug = _slug(f"champion-{p.key[:12]}")
        champion = [Society(slug, _table(params.serving, params.mlflow, slug, p.roles, p.policies),
                            {"eval.key": p.key, "eval.role": "champion", "eval.champions": p.label})]
    books = _replay(params, p, cached[1] if cached else None)
    what = f"evaluate {'the champion and ' if champion else ''}{len(p.societies)} candidate societies x {len(p.tasks)} tasks"
    if params.evaluate.replay:
        what += " (candidates replay the champion's calls of other roles)"
    societies = [*champion, *p.societies]
    traces = society.run_many(params, p.tasks, [(s.table, s.slug) for s in societies], tracking.pipeline_run_id(),
                              p.prompts, score=True, description=what, books=books)
    for s, society_traces in zip(societies, traces, strict=True):
        if s.role is not None and s.target is not None and params.promote.roles[s.role] == "llm":
            check_served(society_traces, s.role, s.version.version, s.target)  # every call of the role: the version
    scored = {s.slug: score(params, s.slug, s.table, t, s.tags)
              for s, t in zip(societies, traces, strict=True)}
    champion_records, champion_run = scored[champion[0].slug] if champion else (cached[0], "cached")  # type: ignore[index]
    champion_cost = society_cost(traces[0] if champion else cached[1])  # type: ignore[index]
    cfg = params.evaluate
    champ = Metrics.model_validate({**summarise(champion_records, cfg.bootstrap, cfg.ci, cfg.seed),
                                    "setting": params.data.setting, "level": Level.SOCIETY})
    entries = {}
    for s, cand_traces in zip(p.societies, traces[len(champion):], strict=True):
        records, run_id = scored[s.slug]
        mine = Metrics.model_validate({**summarise(records, cfg.bootstrap, cfg.ci, cfg.seed),
                                       "setting": params.data.setting, "level": Level.SOCIETY})
        diff = paired_difference(records, champion_records, cfg.bootstrap, cfg.ci, cfg.seed)
        name, cost = str(s.role), society_cost(cand_traces)
        entries[name] = {"role": name, "alias": registry.CHALLENGER, "level": "society",
                         "champion": {"version": p.champions[name].version, "target": p.roles.get(name) or p.policies.get(name),
                                      "label": p.label, "metrics": champ, "run_id": champion_run},
                         "candidate": {"version": s.version.version, "target": s.target, "metrics": mine, "run_id": run_id},
                         "difference": diff, "records": {"champion": champion_records, "candidate": records},
                         "cost": {"champion": champion_cost, "candidate": cost, "replay": cfg.replay}}
        registry.set_tags(name, s.version.version, {
            **evidence_tags(mine, champ, diff, run_id, champion_run, p.champions[name].version),
            "eval.replayed_calls_per_task": f"{cost['replayed_calls_per_task']:.2f}"})
        print(f"evaluate: {name} v{s.version.version} reward {mine.reward.mean:.3f} vs champion "
              f"{champ.reward.mean:.3f}; paired diff {diff.mean:+.3f} CI [{diff.ci_low:+.3f}, {diff.ci_high:+.3f}] "
              f"(n={diff.n}, sign-flip p={diff.p_value:.3f}; decisions McNemar {_mcnemar(diff)}); run {run_id}")
    return entries


def _mcnemar(diff: Difference) -> str:
    m = diff.decision
    return "-" if m is None else f"p={m.p_value:.4f}, b={m.b}, c={m.c}"


def evidence_tags(mine: Metrics, champ: Metrics, diff: Difference, run_id: str, champion_run: str | None,
                  champion_version: str) -> dict[str, str]:
    """The gate's evidence as the candidate version's tags, the same set at every level: what the MLflow UI's
    version page and its compare view show beside the decision ``promote`` adds (``promotion.*``)."""
    tags = {"eval.level": str(mine.level), "eval.setting": str(mine.setting), "eval.tasks": str(diff.n),
            "eval.reward": f"{mine.reward.mean:.4f}", "eval.champion_reward": f"{champ.reward.mean:.4f}",
            "eval.champion_version": str(champion_version), "eval.diff": f"{diff.mean:+.4f}",
            "eval.diff_ci": f"[{diff.ci_low:+.4f}, {diff.ci_high:+.4f}] ({diff.ci:.0%})", "eval.p_value": f"{diff.p_value:.4g}",
            "eval.run": run_id, "eval.run_url": tracking.run_url(run_id), "eval.champion_run": champion_run or ""}
    if (m := diff.decision) is not None:
        tags.update({"eval.mcnemar_p": f"{m.p_value:.4g}", "eval.mcnemar_b_c": f"{m.b}/{m.c} of {m.n}"})
    if (auc := mine.auc) and auc.value is not None:
        tags["eval.auc"] = f"{auc.value:.3f} [{auc.ci_low:.3f}, {auc.ci_high:.3f}]"
    for key, metrics in (("eval.failures", mine), ("eval.champion_failures", champ)):
        if metrics.failures is not None:
            tags[key] = str(metrics.failures.n)
    return tags


@dataclass
class RoleRun:
    """One side of a role-level pair: the champion, a candidate model version, or a candidate prompt version (``prompt``:
    the template whose candidate text the champion's weights render instead of the routed one)."""

    alias: str
    version: Any
    target: str
    prompts: Prompts
    prompt: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    table: str = ""
    seconds: float = 0.0
    metrics: Metrics | None = None
    run_id: str = ""


# whole Params: the role's requests read agents, reward, data, pi, serving and evaluate
def evaluate_role(params: Params, name: str, p: Plan) -> dict[str, Any]:
    """Each candidate of ``name`` (its ``challenger``, an A/A ``aa`` version, a ``challenger`` prompt) against the
    champion on the role's own decision, every validation question (pipeline/evaluation/role_level.py); summary entries
    keyed by role (``@aa``, ``@prompt``)."""
    champion, roles = p.champions[name], p.roles
    runs = _role_runs(params, name, champion, roles, p.prompts)
    if len(runs) == 1:
        print(f"evaluate: {name}: no challenger (champion v{champion.version})")
        return {}
    cfg = params.evaluate
    tasks = load_tasks(params.validate_, "val", None, setting=params.data.setting)  # every question: one prefill each
    url, api_key = proxy.client_settings(params.serving)
    for r in runs:
        slug = _slug(f"{name}-{r.alias}-v{r.version.version}-{p.key[:8]}")
        r.table = json.dumps(_table(params.serving, params.mlflow, slug, {**roles, name: r.target}, p.policies))
        t0 = time.perf_counter()
        with bars() as new:
            shown = new(f"evaluate: {name} v{r.version.version} ({r.alias}) on the validation split", len(tasks))
            r.records = asyncio.run(role_level.decide(url, api_key, name, tasks, params.agents, params.reward,
                                                      params.data.setting, cfg.role_concurrency, cfg.timeout_s, r.prompts,
                                                      slug, progress=shown, rationale=cfg.role_judge))
        r.seconds = time.perf_counter() - t0
    judge_calls = 0
    if cfg.role_judge:
        t0 = time.perf_counter()
        judge_calls = asyncio.run(role_level.judged(url, api_key, tasks, [r.records for r in runs], params.agents,
                                                    params.judge, params.reward, cfg.role_concurrency, cfg.timeout_s,
                                                    p.prompts))
        print(f"evaluate: {name}: the judge scored {judge_calls} distinct answers in {time.perf_counter() - t0:.0f} s")
    for r in runs:  # the figures once the judge's part of the reward is in the records
        _log_role_run(params, name, r)
    cost = {"calls_per_task": 1, "tasks": len(tasks), "judge_calls": judge_calls}
    return dict(_role_entry(cfg, name, champion, runs[0], r, roles[name], p.label, cost) for r in runs[1:])


# whole Params: register_aa's five sections
def _role_runs(params: Params, name: str, champion: Any, roles: dict[str, str], prompts: Prompts) -> list[RoleRun]:
    """The champion first, then each candidate (deployed): ``challenger`` and ``aa`` versions, a ``challenger`` prompt.
    The A/A version is registered here once a challenger was trained."""
    challenger = registry.by_alias(name, registry.CHALLENGER)
    if params.evaluate.aa and challenger is not None and challenger.version != champion.version \
            and registry.by_alias(name, registry.AA) is None:
        aa = registry.register_aa(params, name)
        print(f"evaluate: {name}: A/A candidate v{aa.version} (champion v{champion.version} again)")
    runs = [RoleRun("champion", champion, roles[name], prompts)]
    runs += [RoleRun(alias, c, deploy.deploy(params.serving, name, c, roles.get(name)), prompts)
             for alias in (registry.CHALLENGER, registry.AA)
             if (c := registry.by_alias(name, alias)) is not None and c.version != champion.version]
    if (prompt := prompt_candidate(params.prompt, name, prompts)) is not None:
        # the champion's weights under the candidate prompt: the pair differs in its prompt alone
        template = params.prompt.at(name).template
        runs.append(RoleRun(PROMPT_ALIAS, prompt, roles[name], prompts.with_text(template, str(prompt.template),
                                                                                 int(prompt.version)), template))
    return runs


# whole Params: data.setting and evaluate
def _log_role_run(params: Params, name: str, r: RoleRun) -> None:
    """One side's figures (role_level.metrics) as a nested evaluation run with its routing table and records."""
    cfg, setting = params.evaluate, params.data.setting
    r.metrics = role_level.metrics(r.records, setting, cfg.bootstrap, cfg.ci, cfg.seed)
    with mlflow.start_run(run_name=f"eval {name} {r.alias} v{r.version.version}", nested=True,
                          tags={"pipeline.kind": "evaluation", "eval.role": name, "eval.level": "role",
                                "eval.version": str(r.version.version), "eval.alias": r.alias, "data.setting": setting}) as run:
        mlflow.log_text(r.table, "evaluation/routing.json")
        mlflow.log_metrics({k: v for k, v in flat(r.metrics.model_dump(exclude_unset=True)).items() if v == v})
        mlflow.log_text("".join(json.dumps(x) + "\n" for x in r.records), "evaluation/records.jsonl")
    r.run_id = run.info.run_id
    m = r.metrics
    assert m.failures and m.yes_no and m.auc  # role_level.metrics sets them at the role level
    print(f"evaluate: {name} {r.alias} v{r.version.version} ({r.target}): {len(r.records)} validation questions in "
          f"{r.seconds:.0f} s, {m.failures.n} failed, yes/no accuracy {m.yes_no.accuracy:.3f} "
          f"(n={m.yes_no.n}), AUC {m.auc.value}")


def _role_entry(cfg: EvaluateParams, name: str, champion: Any, champ: RoleRun, r: RoleRun, target: str, label: str,
                cost: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The summary entry of candidate ``r`` against ``champ`` (keyed ``name``, ``name@aa``, ``name@prompt``), and its
    evidence as tags on the version (a prompt pair: the prompt versions compared, both answered by the champion model)."""
    diff = paired_difference(r.records, champ.records, cfg.bootstrap, cfg.ci, cfg.seed)
    entry: dict[str, Any] = {
        "role": name, "alias": r.alias, "level": "role",
        "champion": {"version": champion.version, "target": target, "label": label, "metrics": champ.metrics,
                     "run_id": champ.run_id},
        "candidate": {"version": r.version.version, "target": r.target, "metrics": r.metrics, "run_id": r.run_id},
        "difference": diff, "records": {"champion": champ.records, "candidate": r.records}, "cost": cost}
    key = name if r.alias == registry.CHALLENGER else f"{name}@{r.alias}"
    assert r.metrics and champ.metrics  # _log_role_run scored both sides
    figures = (f"reward {r.metrics.reward.mean:.3f} vs {{}} {champ.metrics.reward.mean:.3f}; paired diff "
               f"{diff.mean:+.3f} (n={diff.n}, sign-flip p={diff.p_value:.4f}")
    if r.prompt is None:
        registry.set_tags(name, r.version.version, evidence_tags(r.metrics, champ.metrics, diff, r.run_id, champ.run_id,
                                                                 champion.version))
        print(f"evaluate: {name} {r.alias} v{r.version.version} {figures.format('champion')}; McNemar {_mcnemar(diff)})")
        return key, entry
    template = r.prompt
    rendered = str(champ.prompts.version(template))
    entry.update(artifact="prompt", template=template, model_version=champion.version)
    entry["champion"]["version"], entry["candidate"]["version"] = rendered, str(r.version.version)
    prompt_registry.set_tags(template, r.version.version, {
        **evidence_tags(r.metrics, champ.metrics, diff, r.run_id, champ.run_id, rendered),
        "eval.model_version": champion.version})
    print(f"evaluate: {name} prompt {template} v{r.version.version} (champion weights v{champion.version}) "
          f"{figures.format(f'prompt v{rendered}')})")
    return key, entry


def prompt_candidate(prompt: PromptParams, name: str, prompts: Prompts) -> Any | None:
    """The role's ``challenger`` prompt version when it is not the version the society renders (``prompts``); None
    otherwise. An identical text under a new version is a candidate: the gate refuses it."""
    if name not in prompt.roles:
        return None
    template = prompt.roles[name].template
    cand = prompt_registry.load(template, f"@{prompt_registry.CHALLENGER}")
    current = prompts.version(template)
    if cand is None or current is None or int(cand.version) == int(current):
        return None
    return cand


def write_outputs(evaluate: EvaluateParams, summary: EvaluationSummary, records: Records) -> None:
    with atomic_dir(evaluate.out_dir) as tmp:
        (tmp / "records").mkdir()
        (tmp / "predictions").mkdir()
        for role, pair in records.items():
            for which, rows in pair.items():
                (tmp / "records" / f"{role}-{which}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                # PubMedQA's own format (PMID -> yes/no/maybe), scorable by its evaluation.py
                answers = {r["task_id"]: answer(r["decision"]) for r in rows}
                (tmp / "predictions" / f"{role}-{which}.json").write_text(json.dumps(answers, indent=1))
        summary.created_at = datetime.now(UTC).isoformat(timespec="seconds")
        # what was given, as given: the same file the dict wrote (an unset default would add keys promote never wrote)
        (tmp / "summary.json").write_text(json.dumps(summary.model_dump(exclude_unset=True), indent=1, default=str))
    metrics = {role: {"candidate_version": int(e.candidate.version), "candidate_reward": e.candidate.metrics.reward.mean,
                      "champion_reward": e.champion.metrics.reward.mean, "diff": e.difference.mean,
                      "diff_ci_low": e.difference.ci_low, "diff_ci_high": e.difference.ci_high,
                      "diff_p_value": e.difference.p_value, "n": e.difference.n,
                      "decision_p_value": e.difference.decision.p_value if e.difference.decision else None}
               for role, e in summary.roles.items()}
    report = {"tasks": len(summary.tasks), "roles": metrics}
    write_json(METRICS_FILE, report)
    metrics_files.write("evaluate", report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options: everything is in params.yaml (evaluate, promote)


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)
    rendered = prompt_registry.sync(params.mlflow, routing.active(params.serving))  # the routed prompt versions
    with tracking.stage_run("evaluate", params.mlflow):
        try:
            summary, records = run(params, rendered)
        finally:
            routing.drop_evals()  # the candidates' tables end with their evaluation
        plot(summary)
        mlflow.log_artifact(str(PLOT), artifact_path="plots")
        write_outputs(params.evaluate, summary, records)
        mlflow.log_artifact(str(Path(params.evaluate.out_dir, "summary.json")), "evaluation")  # the file DVC tracks
    if not summary.roles:
        print("evaluate: no role has a challenger; nothing to compare", file=sys.stderr)
    # a society candidate is paired on the society's validation tasks, a role-level one on every validation question
    sizes = [f"{k} on {e.difference.n} {'questions' if e.level == Level.ROLE else 'tasks'}" for k, e in summary.roles.items()]
    print(f"evaluate: {len(sizes)} candidate(s) ({'; '.join(sizes) or 'none'}) -> {params.evaluate.out_dir}/summary.json")
    return 0
