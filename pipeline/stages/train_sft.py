"""LoRA SFT of the junior researchers on their own high-reward calls (``datasets`` -> adapter).

One stage, two backends (``sft.backend``; ``auto`` picks unsloth when a CUDA device is present):

- ``unsloth`` (GPU workers): ``FastLanguageModel`` + its LoRA patching, trained with TRL's
  ``SFTTrainer`` as unsloth documents.
- ``trl`` (CPU here, or any GPU without unsloth): TRL ``SFTTrainer`` + PEFT LoRA.

Both read the conversational prompt-completion rows of ``datasets`` and render them with the base
model's chat template (the one vLLM serves with); the loss covers the completion (assistant turn)
only. Output, swapped in atomically under ``sft.out_dir``: ``adapter/`` (PEFT, what the vLLM
worker hot-loads), ``merged/`` (HF folder for export), ``log_history.json``.

The training runs in the model plane (torch); the control-plane process that launched it logs the
MLflow run (config, per-step loss + PNG, eval loss, tokens/s) and registers the adapter as a new
version of the ``junior_researcher`` model with its lineage.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import lm_head, metrics_files, plots, timing, tracking, training
from pipeline.config import DatasetsParams, MlflowParams, Params, SftRole
from pipeline.evaluation.significance import sign_flip
from pipeline.io import atomic_dir, read_rows, write_json, write_text
from pipeline.learning import Learning

# This module runs in both planes (its main re-runs itself with --in-model-plane): torch, unsloth, peft, transformers
# and trl are imported where the model plane trains, mlflow and the registry where the control plane logs.



def curves(f: training.Files) -> tuple[Path, Path, Path]:
    """An SFT stage's loss curves: train loss, held-out eval loss (csv for `dvc plots`), both as a PNG."""
    return f.curve("loss", "csv"), f.curve("eval_loss", "csv"), f.curve("loss", "png")


def data_file(datasets: DatasetsParams, role: str) -> Path:
    """The role's SFT rows: its own agents' calls in the best traces (the datasets stage writes one folder per role)."""
    return Path(datasets.out_dir) / "sft" / role / "train.jsonl"


def load_rows(path: Path, minimum: int = 2) -> list[dict[str, Any]]:
    """The rows, each with the keys ``split`` and the trainer read (the PI's rows carry their tokenized form too)."""
    return read_rows(path, minimum, "SFT example", "training needs at least 2 (one is held out for eval loss)",
                     required=("task_id", "prompt", "completion"))


def split(rows: list[dict[str, Any]], sft: SftRole) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Held-out eval slice, whole tasks at a time when possible: at ``datasets.sft.top_k`` > 1 a task's other top rollout
    would otherwise be trained on while its twin is held out, and the held-out signal is tested per task."""
    order = sorted({r["task_id"] for r in rows})
    random.Random(sft.seed).shuffle(order)
    n_eval = max(1, round(len(rows) * sft.eval_fraction))
    held: set[str] = set()
    for task in order:
        if sum(r["task_id"] in held for r in rows) >= n_eval or len(held) == len(order) - 1:
            break
        held.add(task)
    evals = [r for r in rows if r["task_id"] in held]
    if not evals:  # a single task: hold out individual calls instead
        idx = list(range(len(rows)))
        random.Random(sft.seed).shuffle(idx)
        keep = set(idx[:n_eval])
        return [rows[i] for i in range(len(rows)) if i not in keep], _once([rows[i] for i in sorted(keep)])
    return [r for r in rows if r["task_id"] not in held], _once(evals)


def _once(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct row once. A row repeated to weigh it in training (``pi.oversample``) is held out with its copies, and
    counted once there, so the held-out loss is measured on the data's own mix of labels, not on the training weights."""
    return list({json.dumps(r, sort_keys=True): r for r in rows}.values())


def pick_backend(sft: SftRole) -> tuple[str, str | None]:
    """(backend, why ``auto`` fell back to TRL or None). A broken unsloth raises more than ImportError
    (NotImplementedError without a GPU, RuntimeError/AttributeError against the wrong trl or transformers):
    ``auto`` falls back on any of them and says which; ``unsloth`` fails with it."""
    import torch  # noqa: PLC0415 - model plane only

    if sft.backend == "trl":
        return "trl", None
    why: str | None = None
    if not torch.cuda.is_available():
        why = "no CUDA device"
    else:
        try:
            import unsloth  # noqa: F401, PLC0415 - model plane only; before trl/transformers, to patch them
        except Exception as exc:
            why = f"unsloth does not import ({type(exc).__name__}: {str(exc)[:200]})"
    if why is None:
        return "unsloth", None
    if sft.backend == "unsloth":
        raise RuntimeError(f"sft.backend=unsloth: {why}; use trl or auto")
    return "trl", f"sft.backend=auto fell back to TRL: {why}"


def unsloth_load_kwargs(sft: SftRole) -> dict[str, Any]:
    """``FastLanguageModel.from_pretrained``'s keywords (after the model path). A function of its own so that the
    contract test checks these very names against the pinned unsloth release (tests/test_sft_gpu_contract.py)."""
    return {"max_seq_length": sft.max_length, "load_in_4bit": False, "dtype": None}


def unsloth_peft_kwargs(sft: SftRole) -> dict[str, Any]:
    """``FastLanguageModel.get_peft_model``'s keywords (after the model); checked like ``unsloth_load_kwargs``."""
    lora = sft.lora
    return {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": lora.target_modules,
            "random_state": sft.seed, "use_gradient_checkpointing": "unsloth"}


UNSLOTH_MERGED = "merged_16bit"  # save_pretrained_merged's save_method: the merged weights in 16 bit, as vLLM loads them


def trainer_args(sft: SftRole, output_dir: Path, cuda: bool) -> dict[str, Any]:
    """TRL ``SFTConfig``'s keywords, for both backends. ``cuda``: bf16 on the device, else fp32 on the CPU. Checked against
    the GPU image's trl and transformers releases (tests/test_sft_gpu_contract.py), the CPU plane's run them here. One
    evaluation mid-way, past half the steps: beyond 2 steps it never lands on the last, which ``train`` evaluates anyway."""
    return {"output_dir": str(output_dir), "max_steps": sft.max_steps,
            "per_device_train_batch_size": sft.batch_size, "per_device_eval_batch_size": sft.batch_size,
            "gradient_accumulation_steps": sft.grad_accum,
            "learning_rate": sft.learning_rate, "lr_scheduler_type": sft.lr_scheduler,
            "warmup_steps": round(sft.warmup_ratio * sft.max_steps), "logging_steps": 1,
            "eval_strategy": "steps", "eval_steps": sft.max_steps // 2 + 1, "save_strategy": "no", "report_to": "none",
            "max_length": sft.max_length, "completion_only_loss": True, "seed": sft.seed, "data_seed": sft.seed,
            "bf16": cuda, "use_cpu": not cuda, "dataloader_num_workers": 0,
            "disable_tqdm": False, "gradient_checkpointing": sft.gradient_checkpointing}


def _model_and_peft(sft: SftRole, backend: str) -> tuple[Any, Any, Any]:
    """(model, tokenizer, peft_config or None when the model is already wrapped)."""
    lora = sft.lora
    if backend == "unsloth":
        from unsloth import FastLanguageModel  # noqa: PLC0415 - model plane only (GPU)

        model, tokenizer = FastLanguageModel.from_pretrained(sft.base_model, **unsloth_load_kwargs(sft))
        model = FastLanguageModel.get_peft_model(model, **unsloth_peft_kwargs(sft))
        return model, tokenizer, None
    import torch  # noqa: PLC0415 - model plane only
    from peft import LoraConfig  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # CPU: bf16 matmuls are slow without AVX-512 BF16
    with timing.phase(timing.Phase.MODEL_LOAD, plane="model"):
        model = AutoModelForCausalLM.from_pretrained(sft.base_model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(sft.base_model)
    peft = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                      task_type="CAUSAL_LM")
    return model, tokenizer, peft


HeldOut = Callable[[Any, Any, list[dict[str, Any]]], dict[str, Any] | None]  # (model, tokenizer, held-out rows) -> figures


def _nothing(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
    return None


def train(sft: SftRole, data: Path, held_out: HeldOut | None = None) -> dict[str, Any]:
    """Model plane: train on ``data``'s prompt-completion rows (or their tokenized form), save adapter (+ merged folder)
    atomically, return the metrics (train_pi trains the PI with it on its gold-decision rows). ``held_out`` measures the
    model on the held-out rows before and after training (``held_out_before``, ``held_out``; None without it): train_pi's
    discrimination."""
    import torch  # noqa: PLC0415 - model plane only

    rows = load_rows(data)
    train_rows, eval_rows = split(rows, sft)
    backend, fallback_reason = pick_backend(sft)
    from datasets import Dataset  # noqa: PLC0415 - 0.7 s import, only the model plane trains
    from trl import SFTConfig, SFTTrainer  # noqa: PLC0415 - model plane only, after pick_backend (unsloth patches trl)

    lm_head.score_labelled_positions_only()
    model, tokenizer, peft = _model_and_peft(sft, backend)
    # TRL's tokenized form where the rows carry it (the PI's decision-token rows: no EOS appended to the completion)
    columns = ["input_ids", "completion_mask"] if "input_ids" in rows[0] else ["prompt", "completion"]
    train_ds = Dataset.from_list([{k: r[k] for k in columns} for r in train_rows])
    eval_ds = Dataset.from_list([{k: r[k] for k in columns} for r in eval_rows])
    out = Path(sft.out_dir)
    with atomic_dir(out) as tmp:
        args = SFTConfig(**trainer_args(sft, tmp / "checkpoints", torch.cuda.is_available()))
        trainer = SFTTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
                             peft_config=peft)
        # the loss on the training rows themselves, before and after: per-step losses are on different batches (noise
        # at a few steps), the held-out loss may not move at a few rows; the same rows twice say whether it learned
        base_eval = trainer.evaluate()["eval_loss"]
        # the same training rows twice; at most sft.fit_rows of them (a pass over every row costs as much as training)
        fit_ds = train_ds.select(range(min(len(train_ds), sft.fit_rows)))
        fit_before = trainer.evaluate(eval_dataset=fit_ds, metric_key_prefix="fit")["fit_loss"]
        measure = held_out or _nothing
        measured_before = measure(trainer.model, tokenizer, eval_rows)  # the LoRA update is zero: the base model
        t0 = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - t0
        final_eval = trainer.evaluate()["eval_loss"]
        fit_after = trainer.evaluate(eval_dataset=fit_ds, metric_key_prefix="fit")["fit_loss"]
        measured = measure(trainer.model, tokenizer, eval_rows)
        _save(trainer.model, tokenizer, tmp, sft.merge, backend)
        history = trainer.state.log_history
        write_json(tmp / "log_history.json", history)
        losses = [h["loss"] for h in history if "loss" in h]
        tokens = next((h["num_tokens"] for h in reversed(history) if "num_tokens" in h), None)
        third = max(1, len(losses) // 3)
        fit_drop = (fit_before - fit_after) / fit_before if fit_before > 0 else 0.0
        learned = fit_drop >= sft.min_fit_drop
        metrics = {"backend": backend, "fallback_reason": fallback_reason, "role": sft.role,
                   "device": "cuda" if torch.cuda.is_available() else "cpu", "steps": result.global_step,
                   "train_rows": len(train_rows), "eval_rows": len(eval_rows), "train_seconds": round(seconds, 2),
                   "train_loss": result.training_loss, "first_loss": losses[0], "last_loss": losses[-1],
                   "loss_first_third": sum(losses[:third]) / third, "loss_last_third": sum(losses[-third:]) / third,
                   "eval_loss_before": base_eval, "eval_loss": final_eval,
                   "fit_loss_before": fit_before, "fit_loss_after": fit_after, "fit_drop": fit_drop, "no_signal": not learned,
                   "no_signal_reason": None if learned else
                   f"the loss on {min(len(train_rows), sft.fit_rows)} of its own training rows did not fall by sft.min_fit_drop="
                   f"{sft.min_fit_drop:.0%} ({fit_before:.4f} -> {fit_after:.4f}, {fit_drop:+.2%})",
                   "tokens": tokens, "tokens_per_s": (tokens / seconds) if tokens else None,
                   "base_model": str(Path(sft.base_model).resolve()), "held_out_before": measured_before, "held_out": measured}
        write_json(tmp / "train_meta.json", metrics)
    return metrics


def preference(model: Any, tokenizer: Any, held: list[dict[str, Any]], max_length: int) -> dict[str, Any]:
    """Model plane: for each held-out call with a worse counterpart (``rejected``: the same agent's call in its task's
    worst rollout), the mean log-probability per token of the call the best rollout made minus that of the worse one.
    Training on the best calls raises this margin on unseen tasks only if it learned what made them better; the loss on
    its own rows falls whatever the rows are (``learned``)."""
    import torch  # noqa: PLC0415 - model plane only

    tasks, margins = [], []
    mode = model.training
    model.eval()
    with torch.no_grad():
        for r in held:
            if (worse := r.get("rejected")) is None:
                continue
            best = _mean_logprob(model, tokenizer, r["prompt"], r["completion"][0]["content"], max_length)
            tasks.append(r["task_id"])
            margins.append(best - _mean_logprob(model, tokenizer, worse["prompt"], worse["output"], max_length))
    model.train(mode)
    return {"task_ids": tasks, "margins": margins}


def _mean_logprob(model: Any, tokenizer: Any, prompt: list[dict[str, str]], answer: str, max_length: int) -> float:
    """Mean log P of the assistant turn's tokens after ``prompt``, rendered as TRL renders a prompt-completion row (the
    chat template, the completion the rest of the whole conversation); a long prompt is cut from the left."""
    import torch  # noqa: PLC0415 - model plane only

    asked = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": answer}], tokenize=False)
    prefix = tokenizer(asked, add_special_tokens=False)["input_ids"]
    rest = tokenizer(whole[len(asked):] if whole.startswith(asked) else answer, add_special_tokens=False)["input_ids"]
    ids = (prefix + rest)[-max_length:]
    n = min(len(rest), len(ids) - 1)
    logits = model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=n + 1).logits[0, :-1].float()
    target = torch.tensor(ids[-n:], device=logits.device)
    return float(torch.log_softmax(logits, -1).gather(1, target[:, None]).mean())


def learned(metrics: dict[str, Any], alpha: float) -> dict[str, Any]:
    """``metrics`` with the SFT signal: its fit, and whether training raised ``preference``'s margin on the held-out task
    groups beyond chance (the exact sign-flip test of their mean gains at ``sft.signal.alpha``, one-sided)."""
    before, after = metrics["held_out_before"], metrics["held_out"]
    gains: dict[str, list[float]] = defaultdict(list)
    for task, b, a in zip(after["task_ids"], before["margins"], after["margins"], strict=True):
        gains[task].append(a - b)
    per_task = [sum(g) / len(g) for g in gains.values()]
    n, p = len(per_task), sign_flip(per_task)
    mean = {k: sum(m["margins"]) / len(m["margins"]) if m["margins"] else None for k, m in (("before", before), ("after", after))}
    metrics = {**metrics, "held_out_groups": n, "held_out_pairs": len(after["margins"]), "held_out_gain_p": p,
               "held_out_margin_before": mean["before"], "held_out_margin": mean["after"]}
    if metrics["no_signal"]:
        return metrics
    if n == 0:
        why = ("no held-out call has a worse counterpart (the same call in a lower-reward rollout of its task): nothing "
               "to measure what training taught (rollouts.samples_per_task >= 2 gives each task one)")
    elif 0.5 ** n >= alpha:  # the exact test's smallest p: no gain at this n could pass
        why = (f"insufficient evidence: at {n} held-out task group(s) no gain can reach sft.signal.alpha {alpha} (the "
               f"smallest p is {0.5 ** n:.3f}; raise rollouts.limit or sft.eval_fraction)")
    elif p < alpha:
        return metrics
    else:
        why = (f"training did not raise the margin of the best rollouts' calls over the worst's on {n} held-out task "
               f"groups beyond chance ({mean['before']:.4f} -> {mean['after']:.4f}, p = {p:.4f} >= sft.signal.alpha "
               f"{alpha}): no evidence that it learned what made them better, not only its rows")
    return {**metrics, "no_signal": True, "no_signal_reason": why}


SIGNAL = ("held_out_margin_before", "held_out_margin", "held_out_gain_p", "held_out_groups")


def _save(model: Any, tokenizer: Any, tmp: Path, merge: bool, backend: str) -> None:
    """The adapter (and, with ``merge``, the merged bfloat16 model) into the folder being built; the checkpoints out."""
    import torch  # noqa: PLC0415 - model plane only

    model.save_pretrained(str(tmp / "adapter"))
    tokenizer.save_pretrained(str(tmp / "adapter"))
    if merge and backend == "unsloth":
        model.save_pretrained_merged(str(tmp / "merged"), tokenizer, save_method=UNSLOTH_MERGED)
    elif merge:
        model.merge_and_unload().to(torch.bfloat16).save_pretrained(str(tmp / "merged"), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "merged"))
    shutil.rmtree(tmp / "checkpoints", ignore_errors=True)


def _log_curves(history: list[dict[str, Any]], eval_before: float | None, files: tuple[Path, Path, Path],
                title: str) -> None:
    loss_csv, eval_csv, loss_png = files
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    # the base model's eval loss at step 0, then each evaluation (the final one repeats the last step's: kept once)
    evals = sorted({h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}.items())
    evals = ([(0, eval_before)] if eval_before is not None else []) + evals
    write_text(loss_csv, "step,loss\n" + "".join(f"{s},{v}\n" for s, v in train))
    write_text(eval_csv, "step,eval_loss\n" + "".join(f"{s},{v}\n" for s, v in evals))
    with plots.png(loss_png) as ax:
        ax.plot(*zip(*train, strict=True), label="train loss (completion tokens)")
        if evals:
            ax.plot(*zip(*evals, strict=True), "o--", label="eval loss (held-out calls)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.legend()


# whole Params: registry.register_adapter takes it (the role's baseline reads five sections)
def log_and_register(params: Params, role: str, metrics: dict[str, Any], run: Any) -> Any:
    """Control plane: MLflow metrics, curves, adapter artifacts, registered model version with lineage and the trainer's
    held-out evidence; None (tagged no_signal) when it did not fit its rows or showed nothing learned on held-out tasks."""
    import mlflow  # noqa: PLC0415 - control plane only (the model plane, which imports this module, has no mlflow)

    from pipeline import registry  # noqa: PLC0415 - control plane only (MLflow registry, serving), as above

    cfg = params.sft.at(role)
    out, (loss_csv, eval_csv, loss_png) = Path(cfg.out_dir), curves(training.files(Learning.SFT, role))
    history = json.loads((out / "log_history.json").read_text())
    _log_curves(history, metrics.get("eval_loss_before"), (loss_csv, eval_csv, loss_png), f"{role} LoRA SFT")
    mlflow.set_tags({"backend": metrics["backend"], "fallback_reason": metrics.get("fallback_reason") or ""})
    figures = {k: float(metrics[k]) for k in SIGNAL if metrics.get(k) is not None}
    tracking.log_training({**{k: v for k, v in cfg.model_dump().items() if k != "lora"},
                           **{f"lora.{k}": v for k, v in cfg.lora.model_dump().items()}, "backend_used": metrics["backend"],
                           "signal.alpha": params.sft.signal.alpha}, history, {**metrics, **figures}, loss_png)
    if metrics.get("no_signal"):  # no fit, or no held-out evidence of what it learned: nothing to register
        tracking.tag_no_signal(metrics["no_signal_reason"])
        return None
    data = data_file(params.datasets, role)
    # the trainer's evidence travels with the version, as the gate's does (signal.*)
    return registry.register_adapter(params, run, cfg.role, out / "adapter", data.parent, load_rows(data), cfg.base_model,
                                     f"LoRA adapter for the {cfg.role} role (SFT on high-reward rollouts)",
                                     from_traces=True, backend=metrics["backend"],
                                     **{f"signal.{k}": f"{v:.4g}" for k, v in figures.items()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training.role_argument(parser, Learning.SFT)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--in-model-plane", action="store_true", help=argparse.SUPPRESS)


def _summary(metrics: dict[str, Any]) -> str:
    tps = f"{metrics['tokens_per_s']:.0f} tok/s" if metrics.get("tokens_per_s") else "tok/s n/a"
    return (f"train_sft@{metrics.get('role')} [{metrics['backend']}/{metrics['device']}]: {metrics['steps']} steps on "
            f"{metrics['train_rows']} rows, "
            f"loss {metrics['first_loss']:.3f} -> {metrics['last_loss']:.3f}, eval loss {metrics['eval_loss_before']:.3f} -> "
            f"{metrics['eval_loss']:.3f}, loss on its training rows {metrics['fit_loss_before']:.3f} -> "
            f"{metrics['fit_loss_after']:.3f}, {tps}" + _held_out(metrics))


def _held_out(metrics: dict[str, Any]) -> str:
    if metrics.get("held_out_groups") is None:  # the PI's check is its own (train_pi.summary)
        return ""
    margins = " -> ".join("n/a" if metrics[k] is None else f"{metrics[k]:.4f}" for k in SIGNAL[:2])
    return (f", held-out margin best - worst call {margins} on {metrics['held_out_groups']} task groups "
            f"(gain p = {metrics['held_out_gain_p']:.4f})")


def no_signal(sft: SftRole, mlflow: MlflowParams, reason: str, no_mlflow: bool) -> int:
    """Record that this cycle's data carried no signal: the stage's outputs say so, MLflow says so, nothing is registered."""
    metrics = {"backend": None, "no_signal": True, "no_signal_reason": reason, "steps": 0, "role": sft.role}
    with atomic_dir(Path(sft.out_dir)) as tmp:
        write_json(tmp / "train_meta.json", metrics)
    f = training.files(Learning.SFT, sft.role)
    return record_no_signal(f.stage, (f.report, *curves(f)), metrics, mlflow, no_mlflow)


def record_no_signal(stage: str, files: tuple[Path, Path, Path, Path], metrics: dict[str, Any], mlflow: MlflowParams,
                     no_mlflow: bool) -> int:
    """An SFT stage's outputs for a cycle without signal (report, empty curves, the reason on the plot, the MLflow run)."""
    report, loss_csv, eval_csv, loss_png = files
    reason = metrics["no_signal_reason"]
    write_json(report, metrics)
    metrics_files.write(stage, metrics)
    write_text(loss_csv, "step,loss\n")
    write_text(eval_csv, "step,eval_loss\n")
    plots.message(loss_png, f"no signal: {reason}")
    print(f"{stage}: no_signal, nothing trained or registered: {reason}")
    if not no_mlflow:
        tracking.record_no_signal(stage, mlflow, reason, report)
    return 0


# whole Params: its steps read several sections, and registration takes the whole (the role's baseline reads five)
def trainer(params: Params, role: str, no_mlflow: bool) -> training.Trainer:
    """One role's SFT as the shared trainer sequence (pipeline/training.py)."""
    path, cfg, f = data_file(params.datasets, role), params.sft.at(role), training.files(Learning.SFT, role)

    def inputs() -> str | None:
        rows = len(load_rows(path, minimum=0))  # a bad row fails here, in one line, before torch is paid for
        # no rollout passed the SFT filter: nothing to learn from, so nothing is trained or registered
        return f"{path}: {rows} SFT example(s) (training needs 2: one is held out for eval loss)" if rows < 2 else None

    return training.Trainer(
        stage=f.stage, command=Learning.SFT.command, role=role, report=f.report, inputs=inputs,
        no_signal=lambda reason: no_signal(cfg, params.mlflow, reason, no_mlflow),
        train=lambda: learned(train(cfg, path, lambda model, tok, held: preference(model, tok, held, cfg.max_length)),
                              params.sft.signal.alpha),
        register=lambda metrics, run: log_and_register(params, role, metrics, run),
        summary=_summary)


def main(args: argparse.Namespace, params: Params) -> int:
    return training.main(trainer(params, args.role, args.no_mlflow), args, params)
