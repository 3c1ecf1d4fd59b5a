"""The CPU trainer of ``train_ppo``: TRL GRPO + PEFT LoRA on a role's prompts, each decoded under its call's schema.

Runs in the model plane (``python -m pipeline train-ppo --in-model-plane``). Each prompt's group of
sampled completions is scored by ``pipeline.rewards.completion`` (schema validity + the judge through
the proxy + a decision against the label); :func:`signal` says whether the groups carried a
learning signal (GRPO's advantage is zero inside a group of equal rewards).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import lm_head, timing
from pipeline.agents.llm import RoleClient
from pipeline.config import AgentsParams, DatasetsParams, JudgeParams, PpoRole, RewardParams, WorkerParams
from pipeline.io import atomic_dir, write_json, write_text
from pipeline.rewards.completion import completion_text, score
from pipeline.rl.grammar import compile_grammars
from pipeline.rl.prompts import load_prompts
from pipeline.schemas import named

JUDGE_URL_ENV, JUDGE_KEY_ENV = "PPO_JUDGE_BASE_URL", "PPO_JUDGE_KEY"  # the proxy the control plane brought up


def signal(scored: list[dict[str, Any]]) -> dict[str, Any]:
    """Did the sampled completions carry a learning signal? GRPO's advantage is a completion's reward minus
    its group's mean: a group whose rewards are all equal teaches nothing, and when every group is like
    that the update is zero (KL aside) and the adapter is the base model with noise."""
    values = [float(r["value"]) for r in scored]
    groups: dict[str, list[float]] = {}
    for r in scored:
        groups.setdefault(str(r["group"]), []).append(float(r["value"]))
    flat = sum(1 for g in groups.values() if max(g) - min(g) <= 1e-9)
    out: dict[str, Any] = {"completions_scored": len(scored), "groups": len(groups), "zero_advantage_groups": flat,
                           "valid_fraction": sum(r["validity"] == 1.0 for r in scored) / len(scored) if scored else None,
                           "reward_std": statistics.pstdev(values) if values else None}
    reason = ("no completion was scored" if not scored else
              f"every one of the {len(groups)} GRPO groups has equal rewards (reward std {out['reward_std']:.4f}): "
              "all advantages are zero" if flat == len(groups) else None)
    return {**out, "no_signal": reason is not None, "no_signal_reason": reason}


def make_reward(agents: AgentsParams, ppo: PpoRole, judge: JudgeParams, reward: RewardParams,
                log: list[dict[str, Any]]) -> Any:
    """The GRPO reward function: one score per sampled completion, recorded with its reason in ``log``."""
    url, key = os.environ[JUDGE_URL_ENV], os.environ[JUDGE_KEY_ENV]

    calls = itertools.count()

    async def completion_reward(prompts: list[Any], completions: list[Any], agent: list[str], schema: list[str],
                                label: list[str], question: list[str], abstract: list[str], task_id: list[str],
                                trainer_state: Any = None, **_: Any) -> list[float]:
        client = RoleClient.for_agents(agents, url, key, ppo.reward.timeout_s, max_tokens=judge.max_tokens)
        try:
            texts = [completion_text(c) for c in completions]
            results = await asyncio.gather(*[
                score(client, ppo.reward, judge, reward, a, sc, t,
                      {"id": tid, "question": q, "contexts": [ab], "final_decision": lab})
                for a, sc, t, tid, q, ab, lab in zip(agent, schema, texts, task_id, question, abstract, label, strict=True)])
        finally:
            await client.aclose()
        step = int(getattr(trainer_state, "global_step", 0) or 0) + 1
        call = next(calls)  # TRL's batch holds each prompt's group_size completions one after the other
        log.extend({"step": step, "group": f"{call}-{i // ppo.group_size}", "task_id": tid, **r, "completion": t[:800]}
                   for i, (tid, r, t) in enumerate(zip(task_id, results, texts, strict=True)))
        return [float(r["value"]) for r in results]

    return completion_reward


def _prompts(ppo: PpoRole, datasets: DatasetsParams) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The role's prompts and the schemas their calls were decoded under; refuses a completion cap below a budget."""
    rows = load_prompts(datasets, ppo)
    schemas = {r["schema"]: schema for r in rows if (schema := named(r["schema"])) is not None}
    budget = max(s.token_budget() for s in schemas.values())
    if ppo.max_completion_tokens < budget:
        raise ValueError(f"ppo.max_completion_tokens={ppo.max_completion_tokens} is below the schema budget of "
                         f"ppo.roles.{ppo.role}.agents {ppo.agents} ({budget} tokens): completions would be cut into "
                         "invalid JSON")
    return rows, schemas


def _arguments(ppo: PpoRole, out: Path, gpu: bool) -> Any:
    from trl import GRPOConfig  # noqa: PLC0415 - model plane only

    # one sequence per forward/backward, gradients accumulated over the step's GRPO batch (verl's actor: micro batch
    # 1): the activations of 4 sequences of ~1.4k tokens held 16 GB here; generation still batches the whole step
    return GRPOConfig(output_dir=str(out), max_steps=ppo.max_steps, per_device_train_batch_size=1,
                      gradient_accumulation_steps=ppo.prompts_per_step * ppo.group_size, num_generations=ppo.group_size,
                      max_completion_length=ppo.max_completion_tokens, learning_rate=ppo.learning_rate,
                      beta=ppo.kl_coef, temperature=ppo.temperature, logging_steps=1, save_strategy="no", report_to="none",
                      seed=ppo.seed, data_seed=ppo.seed, bf16=gpu, use_cpu=not gpu, dataloader_num_workers=0,
                      disable_tqdm=False, lr_scheduler_type="constant", warmup_steps=0,
                      gradient_checkpointing=ppo.gradient_checkpointing)


def _metrics(ppo: PpoRole, prompts: int, scored: list[dict[str, Any]], history: list[dict[str, Any]], steps_done: int,
             seconds: float, gpu: bool, worker: WorkerParams) -> dict[str, Any]:
    """What the run did: steps and seconds, the reward curve's ends, the signal check, why completions scored as they did."""
    steps = [h for h in history if "reward" in h]
    aligned = [r["aligned"] for r in scored if r.get("aligned") is not None]
    return {"backend": "trl", "algorithm": "grpo", "device": "cuda" if gpu else "cpu", "steps": steps_done,
            "prompts": prompts, "agents": list(ppo.agents), "decoding": f"{worker.structured_backend} JSON schema",
            "compact_json": worker.compact_json, **signal(scored),
            "train_seconds": round(seconds, 2), "seconds_per_step": round(seconds / max(1, steps_done), 2),
            "reward_first": steps[0]["reward"] if steps else None, "reward_last": steps[-1]["reward"] if steps else None,
            "reward_mean": statistics.fmean(r["value"] for r in scored) if scored else None,
            "kl_last": next((h["kl"] for h in reversed(steps) if "kl" in h), None),
            "decision_accuracy": sum(a is True for a in aligned) / len(aligned) if aligned else None,
            "reward_reasons": dict(Counter(r["reason"].split(":")[0] for r in scored)),
            "base_model": str(Path(ppo.base_model).resolve())}


def train_trl(ppo: PpoRole, datasets: DatasetsParams, reward_for: Callable[[list[dict[str, Any]]], Any],
              worker: WorkerParams, text_scale: float = 1.0) -> dict[str, Any]:
    """Model plane: GRPO + LoRA, adapter saved atomically, metrics returned. ``reward_for(log)`` is the reward function
    (:func:`make_reward` with its sections bound), which records each scored completion in ``log``; completions decode
    under the schemas as ``worker`` serves them (its structured-outputs backend and JSON layout, ``agents.text_scale``)."""
    import torch  # noqa: PLC0415 - model plane only
    from datasets import Dataset  # noqa: PLC0415 - 0.7 s import, only training needs it
    from peft import LoraConfig  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    from pipeline.rl.guided import GuidedGRPOTrainer, prompt_key  # noqa: PLC0415 - imports trl (model plane)

    rows, schemas = _prompts(ppo, datasets)
    schema_of = {prompt_key(r["prompt"]): r["schema"] for r in rows}
    columns = ("prompt", "agent", "schema", "label", "question", "abstract", "task_id")
    train_ds = Dataset.from_list([{k: r[k] if k == "prompt" else (r.get(k) or "") for k in columns} for r in rows])
    gpu = torch.cuda.is_available()
    with timing.phase(timing.Phase.MODEL_LOAD, plane="model"):
        model = AutoModelForCausalLM.from_pretrained(ppo.base_model, dtype=torch.bfloat16 if gpu else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(ppo.base_model)
    lora = ppo.lora
    peft = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                      task_type="CAUSAL_LM")
    scored: list[dict[str, Any]] = []
    lm_head.score_labelled_positions_only()  # the policy's log-probabilities on its completions, not on the prompts too
    with atomic_dir(Path(ppo.out_dir)) as tmp:
        trainer = GuidedGRPOTrainer(model=model, reward_funcs=[reward_for(scored)], train_dataset=train_ds,
                                    args=_arguments(ppo, tmp / "checkpoints", gpu), processing_class=tokenizer, peft_config=peft,
                                    grammars=compile_grammars(tokenizer, model.config.vocab_size, schemas, worker, text_scale),
                                    grammar_of=lambda prompt: schema_of[prompt_key(prompt)])
        t0 = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - t0
        trainer.model.save_pretrained(str(tmp / "adapter"))
        tokenizer.save_pretrained(str(tmp / "adapter"))
        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)
        history = [h for h in trainer.state.log_history if "step" in h]
        write_json(tmp / "log_history.json", history)
        write_text(tmp / "completions.jsonl", "".join(json.dumps(r) + "\n" for r in scored))
        metrics = _metrics(ppo, len(rows), scored, history, result.global_step, seconds, gpu, worker)
        write_json(tmp / "train_meta.json", metrics)
    return metrics
