"""The principal investigator learns its decision from the gold label: LoRA SFT on the train split's questions.

RLVR was tried first (docs/benchmarks-before-after.md): GRPO on the decision reward moved the 135M PI from all NO-GO
to all GO, the label prior, with AUC of P(GO) still 0.51. Supervised targets carry the label on every question, not
only where a sampled group disagrees, and one pass fits the decision token on 2 CPU cores (docs/training.md).

Each row is the PI's decision call as the society serves it (``pipeline.agents.decision``: the evidence brief, no
protocol) and, as its completion, the ``PIDecision`` the label asks for: GO for yes, NO-GO for no, DEFER for maybe
(PubMedQA's third answer is a decision too), with the paper's long answer as the rationale (its first
``pi.rationale_chars``, at most the schema's 300).

The steps every trainer takes: fail fast on its inputs (yes and no both present, or ``no_signal``) -> train in the model
plane (``train_sft.train``, TRL ``SFTTrainer`` + PEFT) -> metrics and signal (the loss on its own rows must fall by
``pi.sft.min_fit_drop``, and training must raise the adapter's ranking of held-out yes above no questions beyond
chance, ``pi.signal``) -> register the adapter as ``principal_investigator``'s challenger with its lineage and setting.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from pipeline import tracking, training
from pipeline.agents.decision import decision_messages, target
from pipeline.agents.prompts import REPOSITORY
from pipeline.config import DecisionInput, Params, PiRole, PiSignal, WorkerParams
from pipeline.data.splits import load_tasks
from pipeline.evaluation.significance import auc_gain, rank_auc
from pipeline.io import atomic_dir, write_text
from pipeline.learning import Learning
from pipeline.schemas import Decision, PIDecision
from pipeline.stages import train_sft

GOLD = {label: Decision.for_label(label).value for label in ("yes", "no", "maybe")}


def data_file(pi: PiRole) -> Path:
    return Path(pi.data_dir) / "train.jsonl"


# whole Params: a row reads pi (its target), agents (the brief's length) and data (the setting)
def rows(tasks: list[dict[str, Any]], params: Params) -> list[dict[str, Any]]:
    """The PI's gold-decision rows: one per question of ``tasks`` (maybe -> DEFER), in ``data.setting``, each repeated
    ``pi.oversample[label]`` times (the trainer shuffles)."""
    out = []
    for task in tasks:
        if task["final_decision"] not in GOLD:
            continue
        answer = target(task["final_decision"], (task.get("long_answer") or "")[:params.pi.rationale_chars])
        # the repository's PI template: a DVC stage's rows follow its code, not the live routing (docs/training.md)
        brief_only = decision_messages(task, params.agents, params.data.setting, REPOSITORY, what=DecisionInput.BRIEF)
        row = {"prompt": brief_only,
               # the served JSON layout (agents.decision.prefix's): loss_on answer trains what the society reads
               "completion": [{"role": "assistant", "content": answer}],
               "task_id": task["id"], "rollout_id": task["id"], "run_id": "pubmedqa-gold", "label": task["final_decision"]}
        out.extend([row] * params.pi.oversample.get(task["final_decision"], 1))
    return out


def decision_token_id(tokenizer: Any, prefix: str, decision: str) -> Any:
    """The id of the decision's first token after ``prefix``, as ``tokenizer`` splits the two together: the one token the
    served PI is read from (``decision.ask``: one token at the decision position)."""
    before, ids = tokenizer(prefix)["input_ids"], tokenizer(prefix + decision)["input_ids"]
    if list(ids[:len(before)]) != list(before):  # the decision merged into the prefix's last token: no position to train
        raise ValueError(f"agents.decision.prefix {prefix!r}: the tokenizer merges its end with {decision!r}, so the "
                         "decision has no token of its own after it")
    return ids[len(before)]


def decision_token(tokenizer: Any, prefix: str, decision: str) -> str:
    return str(tokenizer.decode([decision_token_id(tokenizer, prefix, decision)]))


def decision_rows(data: list[dict[str, Any]], tokenizer: Any, prefix: str, end_of_turn: bool) -> list[dict[str, Any]]:
    """``pi.loss_on: decision_token``: each chat row as text, the prompt rendered with the served chat template and
    followed by what the served model writes before the decision (``agents.decision.prefix``), the completion the
    decision's first token, the one the served PI is read from. The loss then falls on the decision, not on JSON the
    model already writes (in the whole answer the decision is 1 token of ~13, and one pass learned only the label prior:
    P(GO) 0.60-0.62 for yes, no and maybe), nor on the rest of its spelling (``-GO"`` after ``NO``: two thirds of the
    loss on tokens that decide nothing, and the recipe a lottery over its seed; docs/training.md). Each row carries
    TRL's tokenized form (``input_ids``, ``completion_mask``), so what is labelled is said here, not by TRL: the
    decision's token and, with ``end_of_turn`` (``pi.end_of_turn``), the tokenizer's EOS after it, as TRL appends it to
    a text completion. The EOS is most of the base model's loss on a row (18.2 nats against the decision's 5.7), and it
    is what keeps the recipe's seeds alike: on the decision's token alone seeds 0 and 1 answered differently on both
    planes (docs/benchmarks-gpu-pi-rows.md)."""
    first = {d.value: decision_token(tokenizer, prefix, d.value) for d in Decision}  # three, not one a row
    if end_of_turn and tokenizer.eos_token_id is None:
        raise ValueError("pi.end_of_turn: the base model's tokenizer has no EOS token to label after the decision")
    eos = [tokenizer.eos_token_id] if end_of_turn else []
    out = []
    for r in data:
        prompt = tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) + prefix
        completion = first[json.loads(r["completion"][0]["content"])["decision"]]
        ids, asked = list(tokenizer(prompt + completion)["input_ids"]), len(tokenizer(prompt)["input_ids"])
        if len(ids) != asked + 1:  # decision_token checked the prefix's end alone; the whole prompt must split there too
            raise ValueError(f"row {r['task_id']}: the prompt and {completion!r} do not split at the decision's token")
        out.append({**r, "prompt": prompt, "completion": completion, "input_ids": ids + eos,
                    "completion_mask": [0] * asked + [1] * (1 + len(eos))})
    return out


DECISION_KEY = re.compile(r'"decision"\s*:\s*"')


def served_prefix(base_model: str, messages: list[dict[str, str]], worker: WorkerParams) -> str:
    """Model plane: what the base model writes before the decision under ``PIDecision``'s schema, greedy, decoded as
    the workers decode it (their structured-outputs backend; ``compact_json``: no free whitespace, so the grammar
    writes ``{"decision":"`` itself; without it SmolLM2-135M writes an opening brace, a newline and two spaces, and an
    adapter drifts from them)."""
    from pipeline.rl.grammar import greedy  # noqa: PLC0415 - model plane only

    text = greedy(base_model, messages, json.dumps(PIDecision.model_json_schema()), worker, 24)
    if (key := DECISION_KEY.search(text)) is None:
        raise RuntimeError(f"{base_model} under PIDecision's schema did not reach the decision in 24 tokens: {text!r}")
    return text[:key.end()]


def training_file(pi: PiRole, prefix: str, worker: WorkerParams) -> Path:
    """Model plane: the file the trainer reads, the chat rows or (``decision_token``) their decision-token form."""
    path = data_file(pi)
    if pi.loss_on == "answer":
        return path
    from transformers import AutoTokenizer  # noqa: PLC0415 - model plane only

    chat = train_sft.load_rows(path)
    served = served_prefix(pi.sft.base_model, chat[0]["prompt"], worker)
    if served != prefix:  # trained after one prefix, read after another: the decision would be taken out of context
        raise ValueError(f"agents.decision.prefix {prefix!r}: the base model {pi.sft.base_model} writes {served!r} "
                         "before its decision under PIDecision's schema; set agents.decision.prefix to that")
    print(f"train_pi: the base model writes {prefix!r} before its decision, as agents.decision.prefix says")
    tokenizer = AutoTokenizer.from_pretrained(pi.sft.base_model)
    rows_ = decision_rows(chat, tokenizer, prefix, pi.end_of_turn)
    out = path.with_name("train.decision.jsonl")  # beside the chat rows, in the stage's DVC output
    write_text(out, "".join(json.dumps(r) + "\n" for r in rows_))
    return out


def discrimination(model: Any, tokenizer: Any, held: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """Model plane: log P(GO) - log P(NO-GO) at the decision's position of each held-out yes and no question, and their
    AUC. The loss on its own rows falls for a PI that learned only the prior or the end-of-turn, even under shuffled
    labels; a better ranking of unseen questions does not (``learned``)."""
    import torch  # noqa: PLC0415 - model plane only

    go, no = (decision_token_id(tokenizer, prefix, d.value) for d in (Decision.GO, Decision.NO_GO))
    tokenized = held if held and "input_ids" in held[0] else decision_rows(held, tokenizer, prefix, end_of_turn=False)
    labels, scores = [], []
    mode = model.training
    model.eval()
    with torch.no_grad():
        for r in tokenized:
            if r["label"] in ("yes", "no"):
                asked = r["input_ids"][:r["completion_mask"].index(1)]
                logits = model(input_ids=torch.tensor([asked], device=model.device), logits_to_keep=1).logits[0, -1]
                labels.append(r["label"])
                scores.append(float(logits[go] - logits[no]))
    model.train(mode)
    pos = [s for s, y in zip(scores, labels, strict=True) if y == "yes"]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == "no"]
    return {"auc": rank_auc(pos, neg) if pos and neg else None, "yes": len(pos), "no": len(neg), "labels": labels,
            "scores": scores}


def learned(metrics: dict[str, Any], signal: PiSignal) -> dict[str, Any]:
    """``metrics`` with the PI's signal: its fit (train_sft's), and whether training raised its held-out AUC of P(GO)
    beyond chance (``significance.auc_gain`` at ``pi.signal.alpha``): the held-out labels permuted over the scores
    before and after, so a base model that happens to rank them is no evidence of what training taught."""
    before, after = metrics["held_out_before"], metrics["held_out"]
    auc_before, auc_after, p = auc_gain(before["scores"], after["scores"], [y == "yes" for y in after["labels"]],
                                        signal.permutations)
    metrics = {**metrics, "held_out_gain_p": p}
    if metrics["no_signal"]:
        return metrics
    if not after["yes"] or not after["no"]:
        why = (f"its held-out slice has {after['yes']} yes and {after['no']} no questions: no ranking to measure "
               "(raise pi.sft.eval_fraction)")
    # before the Monte Carlo p: an exact test at this n could never pass, whatever the draws say
    elif (floor := 1 / math.comb(after["yes"] + after["no"], after["yes"])) >= signal.alpha:
        why = (f"insufficient evidence: at {after['yes']} held-out yes and {after['no']} no questions no gain can reach "
               f"pi.signal.alpha {signal.alpha} (the smallest p of a labelling is {floor:.3f}; raise pi.sft.eval_fraction)")
    elif p < signal.alpha:
        return metrics
    else:
        why = (f"training did not raise its AUC of P(GO) on {after['yes']} held-out yes and {after['no']} no questions "
               f"beyond chance ({auc_before:.3f} -> {auc_after:.3f}, p = {p:.4f} >= pi.signal.alpha "
               f"{signal.alpha}): no evidence that it learned the question's decision, not only the decision's prior")
    return {**metrics, "no_signal": True, "no_signal_reason": why}


def signal_figures(metrics: dict[str, Any]) -> dict[str, float]:
    """The held-out figures of ``learned`` as MLflow reads them (flat numbers)."""
    out = {}
    for key in ("held_out_before", "held_out"):
        if (auc := (metrics.get(key) or {}).get("auc")) is not None:
            out[f"{key}_auc"] = float(auc)
    if "held_out_gain_p" in metrics:
        out["held_out_gain_p"] = float(metrics["held_out_gain_p"])
    return out


def summary(metrics: dict[str, Any]) -> str:
    line = train_sft._summary(metrics).replace("train_sft", "train_pi")
    before, after = metrics["held_out_before"], metrics["held_out"]
    auc = " -> ".join("n/a" if m["auc"] is None else f"{m['auc']:.3f}" for m in (before, after))
    return (f"{line}, held-out AUC of P(GO) {auc} (gain p = {metrics['held_out_gain_p']:.4f}, {after['yes']} yes / "
            f"{after['no']} no)")


def signal(data: list[dict[str, Any]]) -> str | None:
    """Why these rows carry no signal (None when they do): a label the PI never sees the other side of teaches a prior."""
    labels = {r["label"] for r in data}
    if len(data) < 2 or not {"yes", "no"} <= labels:
        return f"{len(data)} gold-decision row(s) with labels {sorted(labels)}: training needs both yes and no questions"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training.role_argument(parser, Learning.PI)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--in-model-plane", action="store_true", help=argparse.SUPPRESS)


# whole Params: the setting (data) is recorded with the reason (mlflow)
def _no_signal(params: Params, role: str, reason: str, no_mlflow: bool) -> int:
    metrics = {"backend": None, "no_signal": True, "no_signal_reason": reason, "steps": 0, "setting": params.data.setting,
               "role": role}
    f = training.files(Learning.PI, role)
    return train_sft.record_no_signal(f.stage, (f.report, *train_sft.curves(f)), metrics, params.mlflow, no_mlflow)


# whole Params: its steps read several sections, and registration takes the whole (the role's baseline reads five)
def trainer(params: Params, role: str, no_mlflow: bool) -> training.Trainer:
    """A role's SFT on the gold decision as the shared trainer sequence (pipeline/training.py)."""
    data: list[dict[str, Any]] = []
    pi, f = params.pi.at(role), training.files(Learning.PI, role)

    def inputs() -> str | None:
        data.extend(rows(load_tasks(params.validate_, "train", setting=params.data.setting), params))
        with atomic_dir(Path(pi.data_dir)) as tmp:
            (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        counts = ", ".join(f"{sum(r['label'] == label for r in data)} {d}" for label, d in GOLD.items())
        print(f"{f.stage}: {len(data)} gold-decision rows ({counts}) in {params.data.setting} -> {data_file(pi)}")
        return signal(data)

    def train() -> dict[str, Any]:
        prefix = params.agents.decision.prefix
        metrics = train_sft.train(pi.sft, training_file(pi, prefix, params.serving.decoding),
                                  lambda model, tok, held: discrimination(model, tok, held, prefix))
        return {**learned(metrics, pi.signal), "setting": params.data.setting}

    return training.Trainer(
        stage=f.stage, command=Learning.PI.command, role=role, report=f.report, inputs=inputs,
        no_signal=lambda reason: _no_signal(params, role, reason, no_mlflow), train=train,
        register=lambda metrics, run: log_and_register(params, role, data, metrics, run),
        summary=summary,
        tags={"data.setting": params.data.setting})


def main(args: argparse.Namespace, params: Params) -> int:
    return training.main(trainer(params, args.role, args.no_mlflow), args, params)


# whole Params: registry.register_adapter takes it (the role's baseline reads five sections)
def log_and_register(params: Params, role: str, data: list[dict[str, Any]], metrics: dict[str, Any], run: Any) -> Any:
    """Control plane, in the stage's MLflow run: curves, config and metrics logged; the adapter registered as the PI's
    challenger with its lineage and setting, or nothing (tagged no_signal) when its loss did not fall."""

    from pipeline import registry  # noqa: PLC0415 - control plane only

    pi, f = params.pi.at(role), training.files(Learning.PI, role)
    cfg, (loss_csv, eval_csv, loss_png) = pi.sft, train_sft.curves(f)
    history = json.loads((Path(cfg.out_dir) / "log_history.json").read_text())
    train_sft._log_curves(history, metrics.get("eval_loss_before"), (loss_csv, eval_csv, loss_png),
                          f"{cfg.role} SFT on the gold decision ({params.data.setting})")
    tracking.log_training({**{k: v for k, v in cfg.model_dump().items() if k != "lora"},
                           **{f"lora.{k}": v for k, v in cfg.lora.model_dump().items()},
                           "backend_used": metrics["backend"], "data.setting": params.data.setting},
                          history, {**metrics, **(figures := signal_figures(metrics))}, loss_png)
    if metrics.get("no_signal"):  # its fit or its held-out ranking showed nothing learned: nothing to register
        tracking.tag_no_signal(metrics["no_signal_reason"])
        return None
    # the trainer's evidence travels with the version, as the gate's does (signal.*)
    version = registry.register_adapter(params, run, cfg.role, Path(cfg.out_dir) / "adapter", Path(pi.data_dir), data,
                                        cfg.base_model, f"LoRA adapter for the {cfg.role} role (SFT on the gold decision)",
                                        from_traces=False, backend=metrics["backend"],
                                        **{"data.setting": params.data.setting},
                                        **{f"signal.{k}": f"{v:.4g}" for k, v in figures.items()})
    return version
