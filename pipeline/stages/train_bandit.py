"""Train the supervisor's contextual bandit on logged decisions and evaluate it off-policy.

Vowpal Wabbit ``--cb_explore_adf`` learns from (context, candidates, chosen, propensity, reward)
with cost = -reward. Before trusting it, the learned policy is compared with the logging policy
(the LLM supervisor with epsilon-greedy exploration) by IPS, SNIPS and doubly-robust estimates
with bootstrap CIs (``pipeline.bandit.ope``); the policy and the DR reward model are cross-fitted
over ``bandit.folds`` folds, so no decision is scored by a model that trained on it. The final
policy, trained on every decision, is registered as a version of ``supervisor_policy`` (a self-contained
MLflow pyfunc whose ``predict`` returns each row's action distribution; ``log_model``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, DataType, Schema
from mlflow.types.schema import Array, Object, Property

from pipeline import lineage, metrics_files, plots, registry, tracking, training
from pipeline.bandit import ope, vw
from pipeline.config import BanditRole, BanditSettings, MlflowParams, Params
from pipeline.io import atomic_dir, read_rows, write_json, write_text
from pipeline.kinds import Kind
from pipeline.learning import Learning, registered_name

# mlflow is imported at the top although a --no-mlflow run does not log: the policy module (pipeline.bandit.vw_policy,
# which every training path imports through pipeline.bandit.vw) imports it already for the pyfunc base class.

PLOT_COLUMNS = "bar,estimator,policy,value,ci_low,ci_high\n"


def ope_plot(f: training.Files) -> tuple[Path, Path]:
    """The off-policy estimates: csv for `dvc plots`, the same bars as a PNG."""
    return f.curve("ope", "csv"), f.curve("ope", "png")


def load_examples(path: Path) -> list[dict[str, Any]]:
    return read_rows(path, 2, "logged decision", "the bandit needs at least 2 (one per cross-fitting fold)",
                     required=("context", "actions", "chosen", "propensity", "reward", "logging_pmf"))


def evaluate_offline(bandit: BanditSettings, examples: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Cross-fitted OPE of the learned policy and of the logging policy on the same decisions."""
    n = len(examples)
    folds = min(bandit.folds, n)
    fold_of = np.random.default_rng(bandit.seed).permutation(n) % folds
    learned: list[list[float]] = [[] for _ in range(n)]
    q: list[list[float]] = [[] for _ in range(n)]
    for f in range(folds):
        train = [examples[i] for i in range(n) if fold_of[i] != f]
        policy, reward_model = vw.train_policy(bandit, train), vw.train_reward_model(bandit, train)
        for i in np.flatnonzero(fold_of == f):
            ex = examples[i]
            learned[i] = vw.pmf(policy, ex["context"], ex["actions"])
            q[i] = vw.predict_rewards(reward_model, ex["context"], ex["actions"])
        policy.finish()
        reward_model.finish()
    common: dict[str, Any] = {"chosen": [e["chosen"] for e in examples], "propensity": [e["propensity"] for e in examples],
                              "reward": [e["reward"] for e in examples], "q": q, "n_boot": bandit.bootstrap, "seed": bandit.seed}
    return {"learned": ope.estimate(learned, **common), "logging": ope.estimate([e["logging_pmf"] for e in examples], **common)}


def print_table(estimates: dict[str, dict[str, dict[str, float]]], n: int) -> None:
    print(f"off-policy evaluation over {n} logged decisions (expected final reward, 95% bootstrap CI):")
    print(f"  {'policy':<9}{'estimator':<10}{'value':>8}   {'95% CI':<17}")
    for policy, table in estimates.items():
        for name, e in table.items():
            print(f"  {policy:<9}{name.upper():<10}{e['value']:>8.3f}   [{e['ci_low']:.3f}, {e['ci_high']:.3f}]")


def plot(estimates: dict[str, dict[str, dict[str, float]]], f: training.Files) -> None:
    names = list(next(iter(estimates.values())))
    csv, png = ope_plot(f)
    write_text(csv, PLOT_COLUMNS + "".join(f"{n}: {p},{n},{p},{t[n]['value']},{t[n]['ci_low']},{t[n]['ci_high']}\n"
                                                for n in names for p, t in estimates.items()))
    with plots.png(png) as ax:
        for j, (policy, table) in enumerate(estimates.items()):
            xs = [i + (j - 0.5) * 0.3 for i in range(len(names))]
            vals = [table[n]["value"] for n in names]
            err = [[v - table[n]["ci_low"] for n, v in zip(names, vals, strict=True)],
                   [table[n]["ci_high"] - v for n, v in zip(names, vals, strict=True)]]
            ax.bar(xs, vals, width=0.3, yerr=err, capsize=4, label=policy)
        ax.set_xticks(range(len(names)), [n.upper() for n in names])
        ax.set_ylabel("estimated reward")
        ax.set_title(f"{f.stage.partition('@')[2]} policy, off-policy estimates (95% CI)")
        ax.legend()


def train_final(bandit: BanditRole, examples: list[dict[str, Any]]) -> Path:
    out = Path(bandit.out_dir)
    with atomic_dir(out) as tmp:
        ws = vw.train_policy(bandit, examples)
        ws.save(str(tmp / "policy.vw"))
        ws.finish()
        write_json(tmp / "policy.json", {"vw_args": vw.policy_args(bandit), "decisions": len(examples)})
    return out / "policy.vw"


CODE_PACKAGE = "supervisor_bandit"  # what mlflow_model.py imports from the model's code/ folder
CODE_FILES = ("vw_policy.py", "features.py")  # of pipeline/bandit: the policy's inference, stdlib + vowpalwabbit only
PIP_REQUIREMENTS = ["vowpalwabbit==9.11.9", "pandas"]
INPUT_EXAMPLE = {"question": "Does the BRCA1 gene variant change outcomes in patients treated with the drug?",
                 "candidates": [{"author": "geneticist", "hypothesis": "The variant changes outcomes through DNA repair.",
                                 "rationale": "BRCA1 repairs DNA.", "evidence_pmids": ["12345678"]},
                                {"author": "pharmacologist", "hypothesis": "The drug works the same with or without the variant.",
                                 "rationale": "", "evidence_pmids": []}]}


def signature() -> Any:
    """Rows of ``question`` + ``candidates`` (hypothesis dicts) -> each row's action distribution."""
    candidate = Object([Property("author", DataType.string), Property("hypothesis", DataType.string),
                        Property("rationale", DataType.string, required=False),
                        Property("evidence_pmids", Array(DataType.string), required=False)])
    return ModelSignature(inputs=Schema([ColSpec(DataType.string, "question"), ColSpec(Array(candidate), "candidates")]),
                          outputs=Schema([ColSpec(Array(DataType.double))]))


def log_model(model_file: Path, name: str) -> Any:
    """Log the policy as a self-contained MLflow pyfunc in the active run: ``mlflow_model.py`` as the model's
    code, ``CODE_FILES`` as the package ``CODE_PACKAGE`` in its ``code/`` folder, the ``.vw`` file as the
    artifact ``vw_model``, a signature and an input example. Nothing of the ``pipeline`` package is needed
    to load it."""
    from pipeline.bandit import mlflow_model  # noqa: PLC0415 - models-from-code: importing it runs mlflow.models.set_model

    src = Path(mlflow_model.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp, CODE_PACKAGE)
        package.mkdir()
        (package / "__init__.py").write_text('"""The supervisor policy\'s inference code, logged with the model '
                                             '(pipeline/bandit)."""\n')
        for rel in CODE_FILES:
            shutil.copyfile(src / rel, package / rel)
        return mlflow.pyfunc.log_model(name=name, python_model=mlflow_model.__file__, artifacts={"vw_model": str(model_file)},
                                       code_paths=[str(package)], signature=signature(),
                                       input_example=pd.DataFrame([INPUT_EXAMPLE]), pip_requirements=PIP_REQUIREMENTS)


# whole Params: registry.register_candidate takes it (the role's baseline reads five sections)
def register(params: Params, role: str, model_file: Path, data_file: Path, examples: list[dict[str, Any]], run: Any) -> Any:
    name = registered_name(Learning.BANDIT, role)
    info = log_model(model_file, name)
    tags = lineage.tags(run, data_file.parent, examples, params.rollouts.out_dir, role=role,
                        kind=Kind.CONTEXTUAL_BANDIT.value,
                        **{"lineage.base_model": "vw --cb_explore_adf"})
    return registry.register_candidate(params, name, info.model_uri, run.info.run_id, tags,
                                       description=f"Contextual bandit that picks the {role}'s hypothesis (VW cb_explore_adf)",
                                       artifact=model_file)  # sha256 of policy.vw: load_policy checks it before VW reads the file


def no_signal_reason(examples: list[dict[str, Any]]) -> str | None:
    """Why these logged decisions cannot teach a policy anything, or None: a decision with one action has no
    alternative to learn, and equal rewards everywhere make every policy worth the same."""
    if all(len(e["actions"]) < 2 for e in examples):
        return f"every one of the {len(examples)} logged decisions offered one action"
    if len({round(float(e["reward"]), 9) for e in examples}) < 2:
        return f"all {len(examples)} logged rewards are equal ({examples[0]['reward']:.4f})"
    return None


def no_signal(bandit: BanditRole, mlflow: MlflowParams, reason: str, no_mlflow: bool) -> int:
    """The outputs and MLflow say the data carried no signal; no policy is trained or registered."""
    with atomic_dir(Path(bandit.out_dir)) as tmp:
        write_json(tmp / "no_signal.json", {"no_signal": True, "no_signal_reason": reason})
    report, f = {"no_signal": True, "no_signal_reason": reason}, training.files(Learning.BANDIT, bandit.role)
    csv, png = ope_plot(f)
    write_json(f.report, report)
    metrics_files.write(f.stage, report)
    write_text(csv, PLOT_COLUMNS)
    plots.message(png, f"no signal: {reason}")
    print(f"{f.stage}: no_signal, nothing trained or registered: {reason}")
    if not no_mlflow:
        tracking.record_no_signal(f.stage, mlflow, reason, f.report)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training.role_argument(parser, Learning.BANDIT)
    parser.add_argument("--no-mlflow", action="store_true")


# whole Params: its steps read several sections, and registration takes the whole (the role's baseline reads five)
def trainer(params: Params, role: str, no_mlflow: bool) -> training.Trainer:
    """A role's contextual bandit (the supervisor's pick) as the shared trainer sequence (pipeline/training.py); VW
    trains here, no model plane."""
    cfg, f = params.bandit.at(role), training.files(Learning.BANDIT, role)
    data_file = Path(params.datasets.out_dir) / "bandit" / "train.jsonl"
    examples: list[dict[str, Any]] = []

    def inputs() -> str | None:
        examples.extend(load_examples(data_file))  # raises naming the file and the rule
        reason = no_signal_reason(examples)
        return None if reason is None else f"{data_file}: {reason}"

    def train() -> dict[str, Any]:
        estimates = evaluate_offline(cfg, examples)
        print_table(estimates, len(examples))
        train_final(cfg, examples)
        plot(estimates, f)
        return {"decisions": len(examples), "ope": estimates,
                "dr_gain": estimates["learned"]["dr"]["value"] - estimates["logging"]["dr"]["value"]}

    def log_and_register(result: dict[str, Any], run: Any) -> Any:
        mlflow.log_params({**cfg.model_dump(), "decisions": len(examples)})
        mlflow.log_metrics({f"ope.{p}.{e}.{k}": v for p, t in result["ope"].items() for e, d in t.items()
                            for k, v in d.items()})
        mlflow.log_metric("ope.dr_gain", float(result["dr_gain"]))
        mlflow.log_artifact(str(ope_plot(f)[1]), artifact_path="plots")
        return register(params, role, Path(cfg.out_dir) / "policy.vw", data_file, examples, run)

    return training.Trainer(
        stage=f.stage, command=Learning.BANDIT.command, role=registered_name(Learning.BANDIT, role), report=f.report,
        inputs=inputs,
        no_signal=lambda reason: no_signal(cfg, params.mlflow, reason, no_mlflow), train=train, register=log_and_register,
        summary=lambda result: f"{f.stage}: doubly robust gain over the logging policy {result['dr_gain']:+.4f} "
                               f"({result['decisions']} logged decisions)",
        in_model_plane=False)


def main(args: argparse.Namespace, params: Params) -> int:
    return training.main(trainer(params, args.role, args.no_mlflow), args, params)
