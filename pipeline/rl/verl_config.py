"""verl's config for LightningRL, composed from Agent Lightning's own verl config plus ``params.ppo``.

Agent Lightning 1.0.2 ships ``agentlightning/verl/config.yaml``: verl's ``ppo_trainer`` defaults plus
what makes it LightningRL (``per_rollout_mean`` policy loss, rollout-level advantage, entropy, no
overlong-prompt filter). Composing verl's bare ``ppo_trainer`` silently loses those, so
:func:`compose` always starts from Agent Lightning's file and applies :func:`overrides` on top (a
verl upgrade keeps its new defaults; an unknown key fails composition).

Both config folders are found from the *installed* packages without importing them
(``importlib.util.find_spec``), so ``python -m pipeline preflight gpu`` composes the exact config a
GPU worker would train with on any machine that has the two wheels installed, GPU or not
(``requirements/contract.txt`` installs verl without its GPU dependencies here). Hydra's
``pkg://verl/...`` search path of Agent Lightning's file would import verl (and torch); it is
replaced by the same folder as a ``file://`` path.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import envs
from pipeline.agents.llm import senior_completion_ceiling
from pipeline.config import AgentsParams, JudgeParams, MlflowParams, PpoSettings, WorkerParams
from pipeline.rl.gateway import AGENT_CLASS, HOOKS_FILE

REDACTED = "<redacted>"


class VerlConfigError(RuntimeError):
    """verl's config cannot be composed (a package missing, an unknown key, a value verl refuses)."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise VerlConfigError(f"{name} is not installed in {sys.executable}: the GPU image installs it "
                              "(requirements/gpu.lock.txt); `make setup` installs it without GPU dependencies for preflight")
    return Path(next(iter(spec.submodule_search_locations)))


def config_dirs() -> tuple[Path, Path]:
    """(Agent Lightning's verl config folder, verl's trainer config folder) of the installed packages."""
    agl = _package_dir("agentlightning") / "verl"
    verl = _package_dir("verl") / "trainer" / "config"
    for folder, file in ((agl, "config.yaml"), (verl, "ppo_trainer.yaml")):
        if not (folder / file).is_file():
            raise VerlConfigError(f"{folder / file}: not found; the installed package does not carry the config this project "
                                  "composes")
    return agl, verl


def attention(kind: str, model: str) -> list[str]:
    """The actor's (or critic's) attention: ``sdpa`` needs no flash-attn (the GPU image has none); verl's
    remove-padding path is flash-attn's varlen kernel, so it goes with ``flash_attention_2`` only."""
    if kind == "flash_attention_2":
        return [f"+{model}.override_config.attn_implementation=flash_attention_2", f"{model}.use_remove_padding=true"]
    return [f"+{model}.override_config.attn_implementation=sdpa", f"{model}.use_remove_padding=false"]


def overrides(ppo: PpoSettings, mlflow: MlflowParams, checkpoints: str | Path, experiment: str,
              worker: WorkerParams) -> list[str]:
    """The project's Hydra overrides over Agent Lightning's verl config, from ``params`` only; ``worker`` is one of the
    serving workers, whose JSON decoding verl's rollout engine takes."""
    so = worker.structured_outputs()
    model = str(Path(ppo.base_model).resolve())
    lora = [] if ppo.full_finetune else [
        f"actor_rollout_ref.model.lora_rank={ppo.lora.r}", f"actor_rollout_ref.model.lora_alpha={ppo.lora.alpha}",
        f"actor_rollout_ref.model.target_modules=[{','.join(ppo.lora.target_modules)}]",
        # Agent Lightning's gateway reaches verl's vLLM over HTTP by the base model's name, and verl attaches the
        # adapter only in its own generate(): unmerged, every rollout would sample the frozen base policy.
        "actor_rollout_ref.model.lora.merge=true",
    ]
    out = [
        f"algorithm.adv_estimator={ppo.algorithm}",
        f"data.train_batch_size={ppo.prompts_per_step}",
        f"data.max_prompt_length={ppo.max_prompt_tokens}",
        f"data.max_response_length={ppo.max_completion_tokens}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(ppo.gradient_checkpointing).lower()}",
        *lora,
        *attention(ppo.attention, "actor_rollout_ref.model"),
        f"actor_rollout_ref.actor.optim.lr={ppo.learning_rate}",
        f"actor_rollout_ref.actor.use_kl_loss={str(ppo.kl_coef > 0).lower()}",
        f"actor_rollout_ref.actor.kl_loss_coef={ppo.kl_coef}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ppo.prompts_per_step}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={ppo.group_size}",
        f"actor_rollout_ref.rollout.temperature={ppo.temperature}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={ppo.rollout_gpu_share}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={ppo.rollout_tensor_parallel}",
        # the society's structured answers are decoded as the workers decode them (backend, JSON layout): under vLLM's
        # defaults (backend auto, free whitespace) the policy would learn on completions the society is never served
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.structured_outputs_config="
        f"{{backend:{so['backend']},disable_any_whitespace:{str(so['disable_any_whitespace']).lower()}}}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"trainer.total_training_steps={ppo.max_steps}",
        "trainer.total_epochs=1000",
        f"trainer.n_gpus_per_node={ppo.gpus}",
        "trainer.nnodes=1",
        # verl's own MLflow logger would log the whole config (the gateway key included) as params: the stage
        # logs the curves itself from the file logger's JSONL (VERL_FILE_LOGGER_PATH)
        "trainer.logger=[console,file]",
        f"trainer.project_name={mlflow.experiment}",
        f"trainer.experiment_name={experiment}",
        f"trainer.default_local_dir={Path(checkpoints).resolve()}",
        # `auto` reloads the last run's checkpoint, sets global_steps past total_training_steps, and Agent
        # Lightning's fit() returns without training: every run starts from the base model
        "trainer.resume_mode=disable",
        f"trainer.save_freq={ppo.max_steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        # every Ray worker: Agent Lightning's loss registration + verl's padding helpers in pure torch without flash-attn
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pipeline.rl.verl_patches.setup_worker",
    ]
    if ppo.algorithm == "gae":
        out += [f"critic.model.path={model}", f"critic.optim.lr={ppo.learning_rate}", "critic.ppo_micro_batch_size_per_gpu=1",
                *attention(ppo.attention, "critic.model")]
    return out + list(ppo.verl_overrides)


def agentlightning_section(ppo: PpoSettings, judge: JudgeParams, agl_url: str, agl_key: str) -> dict[str, Any]:
    """What ``agentlightning.verl`` reads, merged over its defaults (its trainer reads the key from here)."""
    agl = ppo.agl
    return {
        "agl_base_url": agl_url,
        "agl_key": agl_key,
        "hooks": HOOKS_FILE,
        "rollout_timeout_seconds": agl.rollout_timeout_s,
        "reward_fillna_value": judge.failure_score,  # a rollout killed on timeout trains as a failure
        "trace_aggregator": {"level": "transition"},  # LightningRL: each senior call is one transition
        "async_rollout": {"enabled": False, "async_train_batch_size": ppo.prompts_per_step + 1},
        "local": {"agent_class": AGENT_CLASS, "env_map": {"PUBMEDQA_TASK": "input"}},
        "k8s": {"job_template_path": str(Path(agl.job_template).resolve()) if agl.runner == "k8s" else None},
    }


def compose(ppo: PpoSettings, mlflow: MlflowParams, judge: JudgeParams, worker: WorkerParams, checkpoints: str | Path,
            experiment: str, agl_url: str, agl_key: str) -> Any:
    """The trainer's full config (an OmegaConf DictConfig), exactly as ``pipeline.rl.verl_main`` trains with it."""
    agl, verl = config_dirs()
    try:
        with initialize_config_dir(config_dir=str(agl), version_base=None):
            config = hydra_compose(config_name="config", overrides=[f"hydra.searchpath=[file://{verl}]",
                                                                     *overrides(ppo, mlflow, checkpoints, experiment, worker)])
    except (HydraException, OmegaConfBaseException) as exc:
        raise VerlConfigError(f"verl config from {agl / 'config.yaml'} + params.ppo does not compose: {exc}") from exc
    OmegaConf.set_struct(config, False)
    config.agentlightning = OmegaConf.merge(config.agentlightning, agentlightning_section(ppo, judge, agl_url, agl_key))
    return config


def contract(ppo: PpoSettings, agents: AgentsParams, worker: WorkerParams, config: Any) -> list[str]:
    """What the project relies on in the composed config; one message per broken promise (empty: all hold)."""

    def get(key: str) -> Any:
        return OmegaConf.select(config, key)  # None where the key is missing

    problems = []
    for key, want in (("actor_rollout_ref.actor.policy_loss.loss_mode", "per_rollout_mean"),
                      ("algorithm.enable_rollout_level_advantage", True), ("trainer.resume_mode", "disable")):
        if get(key) != want:
            problems.append(f"{key} is {get(key)!r}, LightningRL needs {want!r}")
    if not ppo.full_finetune and get("actor_rollout_ref.model.lora.merge") is not True:
        problems.append("actor_rollout_ref.model.lora.merge is not true: rollouts through the gateway would sample the base "
                        "policy")
    engine = get("actor_rollout_ref.rollout.engine_kwargs.vllm.structured_outputs_config")
    if (OmegaConf.to_container(engine) if engine is not None else None) != worker.structured_outputs():
        problems.append(f"verl's rollout engine decodes JSON with {engine}, the workers with {worker.structured_outputs()}: "
                        "the policy would learn on answers the society is never served")
    ceiling = senior_completion_ceiling(agents)
    if (get("data.max_response_length") or 0) < ceiling:
        problems.append(f"data.max_response_length={get('data.max_response_length')} is below the agents' completion ceiling "
                        f"({ceiling} tokens: agents.max_tokens x designer, agents.token_ceiling): senior answers would train "
                        "cut")
    tp, gpus = get("actor_rollout_ref.rollout.tensor_model_parallel_size"), get("trainer.n_gpus_per_node")
    if not isinstance(tp, int) or not isinstance(gpus, int) or tp > gpus or gpus % tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide "
                        f"trainer.n_gpus_per_node={gpus}")
    if get("trainer.logger") is not None and "mlflow" in list(get("trainer.logger")):
        problems.append("trainer.logger includes mlflow: verl would log the whole config, the gateway key included, as MLflow "
                        "params")
    return problems


def validate(config: Any, python: str, timeout_s: float = 300.0) -> str:
    """verl's own validation of ``config`` under ``python`` (``pipeline.rl.verl_validate``); raises VerlConfigError with its
    output."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fh:
        fh.write(OmegaConf.to_yaml(config))
        fh.flush()
        try:
            out = subprocess.run([python, "-m", "pipeline.rl.verl_validate", fh.name], capture_output=True, text=True,
                                 timeout=timeout_s, cwd=envs.REPO_ROOT, check=False,
                                 env={"PYTHONPATH": str(envs.REPO_ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
        except subprocess.TimeoutExpired as exc:
            raise VerlConfigError(f"verl's validation under {python} took over {timeout_s:.0f}s") from exc
    if out.returncode != 0:
        lines = [line for line in (out.stderr or out.stdout).strip().splitlines() if line.strip()]
        raise VerlConfigError(f"verl {python} refuses the config: {lines[-1] if lines else f'exit {out.returncode}'}")
    return f"verl's validate_config and RolloutConfig accept it (under {python})"


def printable(config: Any) -> str:
    """The config as YAML with the gateway key redacted (it is in the config because Agent Lightning reads it there)."""
    copy: Any = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    if copy.get("agentlightning", {}).get("agl_key"):
        copy.agentlightning.agl_key = REDACTED
    return str(OmegaConf.to_yaml(copy))
