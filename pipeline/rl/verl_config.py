"""verl's Hydra config for LightningRL, generated from ``params.ppo`` (one source of truth).

``overrides`` are applied on top of verl's own ``ppo_trainer`` defaults (so a verl upgrade keeps its
new defaults); ``agentlightning_section`` is the block ``agentlightning.verl`` reads. Pure functions:
unit-tested here, consumed on GPU workers by ``pipeline.rl.verl_main``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.rl.gateway import AGENT_CLASS, HOOKS_FILE


def overrides(params: Params, checkpoints: str | Path, experiment: str) -> list[str]:
    cfg = params.ppo
    model = str(Path(cfg.base_model).resolve())
    lora = [] if cfg.full_finetune else [f"actor_rollout_ref.model.lora_rank={cfg.lora.r}", f"actor_rollout_ref.model.lora_alpha={cfg.lora.alpha}",
                                         f"actor_rollout_ref.model.target_modules=[{','.join(cfg.lora.target_modules)}]"]
    out = [
        f"algorithm.adv_estimator={cfg.algorithm}",
        f"data.train_batch_size={cfg.prompts_per_step}",
        f"data.max_prompt_length={cfg.max_prompt_tokens}",
        f"data.max_response_length={cfg.max_completion_tokens}",
        f"actor_rollout_ref.model.path={model}",
        *lora,
        f"actor_rollout_ref.actor.optim.lr={cfg.learning_rate}",
        f"actor_rollout_ref.actor.use_kl_loss={str(cfg.kl_coef > 0).lower()}",
        f"actor_rollout_ref.actor.kl_loss_coef={cfg.kl_coef}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={cfg.prompts_per_step}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={cfg.group_size}",
        f"actor_rollout_ref.rollout.temperature={cfg.temperature}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"trainer.total_training_steps={cfg.max_steps}",
        "trainer.total_epochs=1000",
        f"trainer.n_gpus_per_node={cfg.gpus}",
        "trainer.nnodes=1",
        "trainer.logger=[console,mlflow]",
        f"trainer.project_name={params.mlflow.experiment}",
        f"trainer.experiment_name={experiment}",
        f"trainer.default_local_dir={Path(checkpoints).resolve()}",
        f"trainer.save_freq={cfg.max_steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    ]
    if cfg.algorithm == "gae":
        out += [f"critic.model.path={model}", f"critic.optim.lr={cfg.learning_rate}", "critic.ppo_micro_batch_size_per_gpu=1"]
    return out + list(cfg.verl_overrides)


def agentlightning_section(params: Params, agl_url: str, agl_key: str) -> dict[str, Any]:
    cfg = params.ppo.agl
    return {
        "agl_base_url": agl_url,
        "agl_key": agl_key,
        "hooks": HOOKS_FILE,
        "rollout_timeout_seconds": cfg.rollout_timeout_s,
        "reward_fillna_value": params.judge.failure_score,  # a rollout killed on timeout trains as a failure
        "trace_aggregator": {"level": "transition"},  # LightningRL: each senior call is one transition
        "async_rollout": {"enabled": False, "async_train_batch_size": params.ppo.prompts_per_step + 1},
        "local": {"agent_class": AGENT_CLASS, "env_map": {"PUBMEDQA_TASK": "input"}},
        "k8s": {"job_template_path": str(Path(cfg.job_template).resolve()) if cfg.runner == "k8s" else None},
    }


def adapter_from_checkpoint(checkpoints: Path, dest: Path) -> None:
    """verl saves ``global_step_<N>/actor/lora_adapter`` (PEFT) for LoRA runs: the newest one becomes ``dest``."""
    steps = sorted(checkpoints.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if not steps:
        raise FileNotFoundError(f"{checkpoints}: verl saved no global_step_* checkpoint")
    adapter = steps[-1] / "actor" / "lora_adapter"
    if not (adapter / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter}: no PEFT adapter (ppo.full_finetune runs produce a full model, which needs its own worker)")
    shutil.copytree(adapter, dest)
