"""The ``prompt`` kind of learning: a role's prompt gains few-shot demonstrations, proposed as a Prompt Registry version.

The role's current prompt (the version the live routing renders) is optimized by ``mlflow.genai.optimize_prompts`` with
:class:`pipeline.prompt_optimizer.FewShotOptimizer` against the served role through the proxy (its champion weights),
on the train split's yes/no questions only: a dev set scores every candidate, the rest is the demonstrations' pool, and
the gate's validation questions are never seen. A candidate that beat the current prompt on the dev set is registered
by ``optimize_prompts`` as a new version of ``society.<template>``, tagged with its lineage (sha, the version it grew
from, the run, dev scores) and aliased ``challenger``; ``evaluate`` then scores it on the validation split beside the
role's other candidates. No candidate changed a decision (``no_signal``) or none beat it (``no_gain``): nothing is
registered. ``reports/train_prompt.json`` has what the optimizer measured: metric before/after, calls and wall time;
``<out_dir>/prompt.json`` (a DVC output, as every kind's artifact) the registered candidate's text, or none.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import metrics_files, prompt_registry, training
from pipeline.agents import prompts
from pipeline.config import Params, PromptRole, ValidateParams
from pipeline.data.splits import load_tasks, split_file
from pipeline.io import atomic_dir, write_json
from pipeline.learning import Learning
from pipeline.serving import proxy, routing, stack


def _tasks(validate: ValidateParams, setting: str) -> list[dict[str, Any]]:
    return load_tasks(validate, "train", None, setting=setting)


def run(params: Params, role: str) -> dict[str, Any]:
    """Run the optimizer on the routed version of the template; the report (``version`` when one was registered)."""
    import mlflow  # noqa: PLC0415 - control plane only
    import mlflow.genai  # noqa: PLC0415

    from pipeline.prompt_optimizer import FewShotOptimizer, decision_scorer, predictor, record, split  # noqa: PLC0415

    cfg = params.prompt.at(role)
    stack.ensure(params.serving, params.mlflow)
    base = prompt_registry.sync(params.mlflow, routing.active(params.serving)).version(cfg.template)
    current = prompt_registry.load(cfg.template, base) if base is not None else None
    if current is None:
        raise RuntimeError(f"prompt {cfg.template} v{base}: not in the Prompt Registry")
    pool, dev = split(_tasks(params.validate_, params.data.setting), cfg.dev_questions, cfg.seed)
    url, key = proxy.client_settings(params.serving)
    predict = predictor(url, key, current, cfg.role, params.agents, params.data.setting, params.agents.decision.prefix,
                        params.evaluate.timeout_s)
    opt = FewShotOptimizer(cfg, pool, params.data.setting, params.agents.decision.prefix)
    # MLflow's eval threads (metric calls in flight); its own trace check calls the function once, traced already
    with _environ(MLFLOW_GENAI_EVAL_MAX_WORKERS=str(cfg.concurrency), MLFLOW_GENAI_EVAL_SKIP_TRACE_VALIDATION="true"):
        result = mlflow.genai.optimize_prompts(predict_fn=predict, train_data=[record(t) for t in dev],
                                               prompt_uris=[current.uri], optimizer=opt, scorers=[decision_scorer()])
    before, best = opt.scored[0], max(opt.scored, key=lambda s: (s.score, s.auc or 0.0))
    report: dict[str, Any] = {
        "role": cfg.role, "template": cfg.template, "optimizer": cfg.optimizer, "status": opt.status,
        "no_signal": opt.status != "trained", "base_version": base, "version": None,
        "setting": params.data.setting, "dev": {"n": len(dev), "before": before.score, "after": best.score,
                                                "auc_before": before.auc, "auc_after": best.auc},
        "pool": len(pool), "calls": opt.calls, "seconds": round(opt.seconds, 1),
        "candidates": [{"name": s.name, "score": s.score, "auc": s.auc, "demo_ids": s.demo_ids} for s in opt.scored]}
    if opt.status == "no_signal":
        report["no_signal_reason"] = (f"no demonstration changed one of the {len(dev)} dev decisions "
                                      f"({len(opt.scored) - 1} candidate(s))")
    elif opt.status == "no_gain":
        report["no_signal_reason"] = (f"no candidate beat the current prompt's dev accuracy {before.score:.3f} by more than "
                                      f"prompt.min_gain={cfg.min_gain} (best {best.score:.3f}, n={len(dev)})")
    text = None  # the registered candidate's
    if result.optimized_prompts:
        version = result.optimized_prompts[0]
        text = str(version.template)
        run = mlflow.active_run()
        prompt_registry.set_tags(cfg.template, version.version, {
            "sha": prompts.digest(text), "source": "train_prompt", "optimizer": cfg.optimizer,
            "parent_version": base, "run_id": run.info.run_id if run else "", "setting": params.data.setting,
            "dev.n": len(dev), "dev.before": f"{before.score:.4f}", "dev.after": f"{best.score:.4f}",
            "demo_ids": ",".join(best.demo_ids)})
        report["version"] = int(version.version)
    write_artifact(cfg, report, text)
    mlflow.log_metrics({"prompt.dev_before": before.score, "prompt.dev_after": best.score, "prompt.calls": opt.calls,
                        "prompt.seconds": opt.seconds})
    return report


def write_artifact(cfg: PromptRole, report: dict[str, Any], text: str | None) -> None:
    """The stage's DVC output: which version of the template it registered, and its text (None: nothing registered)."""
    with atomic_dir(Path(cfg.out_dir)) as tmp:
        write_json(tmp / "prompt.json", {"role": cfg.role, "template": cfg.template, "status": report["status"],
                                         "base_version": report.get("base_version"), "version": report["version"],
                                         "sha": None if text is None else prompts.digest(text), "text": text})


# whole Params: its steps read the prompt, data, validate, serving, mlflow, agents, pi and evaluate sections
def trainer(params: Params, role: str) -> training.Trainer:
    """The prompt optimizer as the shared trainer sequence (pipeline/training.py): no model plane, the served role."""
    cfg, f = params.prompt.at(role), training.files(Learning.PROMPT, role)

    def inputs() -> str | None:
        if cfg.template not in prompts.TEMPLATES:
            raise ValueError(f"params.yaml prompt.roles.{role}.template: {cfg.template!r} is not a template of "
                             "pipeline/agents/prompts.py")
        if not split_file(params.validate_, "train").exists():
            raise FileNotFoundError(f"{split_file(params.validate_, 'train')}: run the validate stage first")
        yes_no = sum(t["final_decision"] in ("yes", "no") for t in _tasks(params.validate_, params.data.setting))
        if yes_no < cfg.dev_questions + cfg.demos:
            return f"{yes_no} yes/no train questions < prompt.dev_questions + prompt.demos"
        return None

    def no_signal(reason: str) -> int:
        report = {"role": cfg.role, "template": cfg.template, "status": "no_signal", "no_signal": True,
                  "no_signal_reason": reason, "version": None}
        write_artifact(cfg, report, None)
        write_json(f.report, report)
        metrics_files.write(f.stage, report)
        print(f"{f.stage}: no_signal, nothing registered: {reason}")
        return 0

    def register(report: dict[str, Any], run: Any) -> Any:
        del run
        if report.get("version") is None:
            return None
        prompt_registry.set_alias(cfg.template, prompt_registry.CHALLENGER, report["version"])
        return prompt_registry.load(cfg.template, report["version"])

    def summary(r: dict[str, Any]) -> str:
        dev = r["dev"]
        return (f"{f.stage}: {r['role']} ({r['template']} v{r['base_version']}): dev accuracy {dev['before']:.3f} -> "
                f"{dev['after']:.3f} (n={dev['n']}, AUC {dev['auc_before']} -> {dev['auc_after']}); {r['status']}; "
                f"{r['calls']} metric calls in {r['seconds']:.0f} s")

    return training.Trainer(stage=f.stage, command=Learning.PROMPT.command, role=prompt_registry.registered_name(cfg.template),
                            report=f.report, inputs=inputs, no_signal=no_signal, train=lambda: run(params, role),
                            register=register, summary=summary, in_model_plane=False,
                            uri=lambda v: f"prompts:/{v.name}/{v.version}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training.role_argument(parser, Learning.PROMPT)
    parser.set_defaults(no_mlflow=False)  # a prompt version lives in MLflow's Prompt Registry: there is no run without it


def main(args: argparse.Namespace, params: Params) -> int:
    return training.main(trainer(params, args.role), args, params)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for a block (MLflow reads its eval settings from the environment), then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
