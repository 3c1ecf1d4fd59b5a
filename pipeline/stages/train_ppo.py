"""Online RL of a role (``ppo.roles``: ``datasets`` RL prompts of its agents -> an adapter for the role).

One stage, two backends (``ppo.backend``; ``auto`` picks verl when a CUDA device and verl are there):

- ``verl`` (GPU workers): LightningRL through Agent Lightning. ``agl-server`` (gateway + store) and
  ``agl-controller`` run the society once per rollout (``pipeline.rl.agent``): only the senior
  calls reach the policy being trained, each one a transition credited with the rollout's reward;
  verl's trainer (``agentlightning.verl.run_ppo``, Hydra config generated from ``params.ppo`` by
  ``pipeline.rl.verl_config``) updates it with GRPO (``algorithm: grpo``) or PPO with a critic
  (``gae``). This process starts the three, supervises them (any one dying stops the others and
  fails the stage naming it) and stops them. Every rollout lands in the RL trace store.
- ``trl`` (CPU here): TRL ``GRPOTrainer`` + PEFT LoRA on the prompts the society actually sent the role's trained
  agents (``datasets`` -> ``rl/hf``), each sampled under the schema its call was decoded under; each prompt's group
  of sampled completions is scored by ``pipeline.rewards.completion`` (schema validity + the judge through the proxy
  + a decision against the label).

Both leave ``adapter/`` (PEFT, what the vLLM worker hot-loads) under ``ppo.out_dir``, swapped in
atomically; the control plane logs reward/KL curves, sampled completions and the adapter to MLflow
and registers it as a version of the role (``challenger``) with its lineage, so promotion
hot-loads and routes it exactly like the SFT adapter.

The trainers live in ``pipeline.rl.grpo_cpu`` (CPU) and ``pipeline.rl.verl_driver`` (GPU); this module is the
stage that chooses between them (a said plane, a backend with its fallback reason) and registers.
"""


from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline import envs, plots, tracking, training
from pipeline.config import Params, PpoRole, PpoSettings
from pipeline.io import atomic_path, write_text
from pipeline.learning import Learning
from pipeline.rl.grpo_cpu import JUDGE_KEY_ENV, JUDGE_URL_ENV, make_reward, train_trl
from pipeline.rl.prompts import data_dir, load_prompts
from pipeline.rl.verl_driver import train_verl

# This module runs in both planes (the TRL path re-runs it with --in-model-plane, and the backend probe imports it
# there): torch is imported where the model plane needs it; mlflow, the registry and the serving stack where the
# control plane uses them.



def pick_backend(ppo: PpoSettings) -> tuple[str, str | None]:
    """(backend, why ``auto`` fell back to TRL or None), decided in the model plane where torch is."""
    import torch  # noqa: PLC0415 - model plane only

    want = ppo.backend
    if want == "trl":
        return "trl", None
    missing = [m for m in ("verl", "agentlightning") if importlib.util.find_spec(m) is None]
    why = "no CUDA device" if not torch.cuda.is_available() else (f"{', '.join(missing)} not installed" if missing else None)
    if why is None:
        return "verl", None
    if want == "verl":
        raise RuntimeError(f"ppo.backend=verl: {why} (the GPU worker image has CUDA, verl and agentlightning); use trl or auto")
    return "trl", f"ppo.backend=auto fell back to TRL GRPO: {why}"


def resolve_backend(ppo: PpoRole, params_path: str | None) -> tuple[str, str | None]:
    """:func:`pick_backend` asked of the model plane's interpreter (the control plane has no torch)."""
    if ppo.backend == "trl":
        return "trl", None
    probe = ("import json, sys; from pipeline.config import load_params; from pipeline.stages.train_ppo import pick_backend\n"
             "try:\n print(json.dumps(pick_backend(load_params(sys.argv[1] or None).ppo)))\n"
             "except RuntimeError as exc:\n print(json.dumps(['error', str(exc)]))")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(envs.REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([envs.model_python(), "-c", probe, params_path or ""], capture_output=True, text=True, check=False,
                         env=env, timeout=300)
    try:
        backend, why = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as exc:
        raise RuntimeError(f"could not ask the model plane ({envs.model_python()}) for a ppo backend: "
                           f"{out.stderr[-1500:]}") from exc
    if backend == "error":
        raise RuntimeError(why)
    return backend, why


# --- control plane: MLflow + registry -------------------------------------------------------------------

def curve(f: training.Files) -> tuple[Path, Path]:
    """The GRPO curve: mean reward and KL per step (csv for `dvc plots`, PNG for MLflow)."""
    return f.curve("reward", "csv"), f.curve("reward", "png")


def _log_curves(history: list[dict[str, Any]], f: training.Files) -> None:
    rows = [h for h in history if "reward" in h]
    csv, png = curve(f)
    write_text(csv, "step,reward,kl\n"
               + "".join(f"{h['step']},{h['reward']},{'' if h.get('kl') is None else h['kl']}\n" for h in rows))
    with plots.png(png) as ax:
        steps = [h["step"] for h in rows]
        ax.plot(steps, [h["reward"] for h in rows], "o-", label="mean reward of sampled completions")
        if any("kl" in h for h in rows):
            ax.plot(steps, [h.get("kl", float("nan")) for h in rows], "s--", label="KL to the base policy")
        ax.set_xlabel("step")
        ax.set_title(f"{f.stage.partition('@')[2]} GRPO")
        ax.legend()


# whole Params: registry.register_adapter takes it (the role's baseline reads five sections)
def log_and_register(params: Params, role: str, metrics: dict[str, Any], run: Any) -> Any:
    import mlflow  # noqa: PLC0415 - control plane only (the model plane, which imports this module, has no mlflow)

    from pipeline import registry  # noqa: PLC0415 - control plane only (MLflow registry, serving), as above

    cfg, f = params.ppo.at(role), training.files(Learning.PPO, role)
    out = Path(cfg.out_dir)
    history = json.loads((out / "log_history.json").read_text())
    _log_curves(history, f)
    tracking.log_training({**{k: v for k, v in cfg.model_dump().items() if k not in ("lora", "reward", "agl", "verl_overrides")},
                           **{f"lora.{k}": v for k, v in cfg.lora.model_dump().items()},
                           **{f"reward.{k}": v for k, v in cfg.reward.model_dump().items()}, "backend_used": metrics["backend"]},
                          history, metrics, curve(f)[1])
    if (out / "completions.jsonl").exists():
        scored = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        if scored:
            columns = ("step", "agent", "task_id", "value", "validity", "judge", "aligned", "reason", "completion")
            mlflow.log_table({k: [r.get(k) for r in scored] for k in columns}, artifact_file="completions.json")
    if metrics.get("no_signal"):  # an adapter trained on zero advantages is the base model: nothing to register or evaluate
        tracking.tag_no_signal(metrics["no_signal_reason"])
        return None
    rows = [{"run_id": r.get("run_id", "")} for r in load_prompts(params.datasets, cfg)]
    return registry.register_adapter(params, run, cfg.role, out / "adapter", data_dir(params.datasets), rows, cfg.base_model,
                                     f"LoRA adapter for the {cfg.role} role (online RL on the society's rollouts)",
                                     backend=metrics["backend"], algorithm=metrics["algorithm"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training.role_argument(parser, Learning.PPO)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--in-model-plane", action="store_true", help=argparse.SUPPRESS)


def _summary(m: dict[str, Any]) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"train_ppo [{m['backend']}/{m['algorithm']}/{m['device']}]: {m['steps']} steps, {m['seconds_per_step']} s/step, "
            f"reward {fmt(m.get('reward_first'))} -> {fmt(m.get('reward_last'))} (mean {fmt(m.get('reward_mean'))}), "
            f"KL {fmt(m.get('kl_last'))}, reasons {m.get('reward_reasons', {})}; valid {fmt(m.get('valid_fraction'))}, "
            f"reward std {fmt(m.get('reward_std'))}, "
            f"{m.get('zero_advantage_groups')}/{m.get('groups')} groups with zero advantage"
            + (f"; NO SIGNAL: {m['no_signal_reason']}" if m.get("no_signal") else ""))


# whole Params: its steps read several sections, and registration takes the whole (the role's baseline reads five)
def trainer(params: Params, role: str, backend: str, why: str | None) -> training.Trainer:
    """A role's online RL as the shared trainer sequence (pipeline/training.py): TRL GRPO in the model plane, or
    verl through Agent Lightning driven from here (its workers are the GPU's)."""
    ppo, f = params.ppo.at(role), training.files(Learning.PPO, role)

    def inputs() -> None:
        load_prompts(params.datasets, ppo)  # raises naming the folder when the datasets stage left too few
        from pipeline.serving import stack  # noqa: PLC0415 - control plane only (serving); the model plane imports this module

        url, key = stack.ensure(params.serving, params.mlflow)  # the judge scores completions through the proxy
        os.environ[JUDGE_URL_ENV], os.environ[JUDGE_KEY_ENV] = url, os.environ.get("LLM_API_KEY", key)
        return None  # GRPO's signal is measured on the sampled completions (grpo_cpu.signal)

    def train_grpo() -> dict[str, Any]:
        reward_for = functools.partial(make_reward, params.agents, ppo, params.judge, params.reward)
        metrics = {**train_trl(ppo, params.datasets, reward_for, params.serving.decoding,
                               params.agents.text_scale), "fallback_reason": why, "role": role}
        # the CPU path's training samples are its scored completions: into the RL trace store with them
        with atomic_path(Path(params.ppo.agl.trace_dir) / "grpo-completions.jsonl") as dest:
            shutil.copyfile(Path(ppo.out_dir) / "completions.jsonl", dest)
        return metrics

    def train_with_verl() -> dict[str, Any]:
        import mlflow  # noqa: PLC0415 - control plane only

        run = mlflow.active_run()
        if run is None:
            raise RuntimeError("the verl backend logs its steps to the stage's MLflow run: run it without --no-mlflow")
        try:
            return {**train_verl(ppo, params.serving, params.gpu, run.info.run_id), "fallback_reason": why, "role": role}
        except Exception as exc:  # a failed GPU job: one line, the stage fails
            raise RuntimeError(str(exc)) from exc

    def no_signal(reason: str) -> int:
        raise AssertionError(f"train_ppo measures its signal on the completions, not its inputs: {reason}")

    return training.Trainer(
        stage=f.stage, command=Learning.PPO.command, role=role, report=f.report, inputs=inputs,
        no_signal=no_signal, train=train_with_verl if backend == "verl" else train_grpo,
        register=lambda metrics, run: log_and_register(params, role, metrics, run), summary=_summary,
        in_model_plane=backend != "verl", tags={"backend": backend, "fallback_reason": why or ""})


def main(args: argparse.Namespace, params: Params) -> int:
    """Control plane (what the DAG and dvc.yaml run, on any worker): the backend, then the shared trainer sequence.
    ``--in-model-plane`` (said by the control plane, never guessed from what imports) trains with TRL."""
    if args.in_model_plane:
        backend, why = pick_backend(params.ppo.at(args.role))
        if backend == "verl":
            print("error: the verl backend is driven from the control plane (`python -m pipeline train-ppo`)", file=sys.stderr)
            return 1
        return training.main(trainer(params, args.role, "trl", why), args, params)
    try:
        backend, why = resolve_backend(params.ppo.at(args.role), args.params_path)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if why:
        print(f"train_ppo: {why}")
    return training.main(trainer(params, args.role, backend, why), args, params)
