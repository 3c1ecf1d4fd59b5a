"""Online RL of the senior researchers (``datasets`` RL prompts -> adapter for ``senior_researcher``).

One stage, two backends (``ppo.backend``; ``auto`` picks verl when a CUDA device and verl are there):

- ``verl`` (GPU workers): LightningRL through Agent Lightning. ``agl-server`` (gateway + store) and
  ``agl-controller`` run the society once per rollout (``pipeline.rl.agent``): only the senior
  calls reach the policy being trained, each one a transition credited with the rollout's reward;
  verl's trainer (``agentlightning.verl.run_ppo``, Hydra config generated from ``params.ppo`` by
  ``pipeline.rl.verl_config``) updates it with GRPO (``algorithm: grpo``) or PPO with a critic
  (``gae``). This process starts the three, supervises them (any one dying stops the others and
  fails the stage naming it) and stops them. Every rollout lands in the RL trace store.
- ``trl`` (CPU here): TRL ``GRPOTrainer`` + PEFT LoRA on the senior prompts the society actually
  sent (``datasets`` -> ``rl/hf``); each prompt's group of sampled completions is scored by
  ``pipeline.rewards.senior`` (schema validity + the judge through the proxy + PI alignment).

Both leave ``adapter/`` (PEFT, what the vLLM worker hot-loads) under ``ppo.out_dir``, swapped in
atomically; the control plane logs reward/KL curves, sampled completions and the adapter to MLflow
and registers it as a ``senior_researcher`` version (``challenger``) with its lineage, so promotion
hot-loads and routes it exactly like the SFT adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.io import atomic_dir, write_json, write_text
from pipeline.rl.prompts import data_dir, load_prompts

METRICS_FILE = Path("reports/train_ppo.json")
CURVE_CSV = Path("reports/plots/ppo_reward.csv")
CURVE_PNG = Path("reports/plots/ppo_reward.png")
JUDGE_URL_ENV, JUDGE_KEY_ENV = "PPO_JUDGE_BASE_URL", "PPO_JUDGE_KEY"


def signal(scored: list[dict[str, Any]]) -> dict[str, Any]:
    """Did the sampled completions carry a learning signal? GRPO's advantage is a completion's reward minus
    its group's mean: a group whose rewards are all equal teaches nothing, and when every group is like
    that the update is zero (KL aside) and the adapter is the base model with noise."""
    import statistics

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


def pick_backend(params: Params) -> tuple[str, str | None]:
    """(backend, why ``auto`` fell back to TRL or None), decided in the model plane where torch is."""
    import importlib.util

    import torch

    want = params.ppo.backend
    if want == "trl":
        return "trl", None
    missing = [m for m in ("verl", "agentlightning") if importlib.util.find_spec(m) is None]
    why = "no CUDA device" if not torch.cuda.is_available() else (f"{', '.join(missing)} not installed" if missing else None)
    if why is None:
        return "verl", None
    if want == "verl":
        raise RuntimeError(f"ppo.backend=verl: {why} (the GPU worker image has CUDA, verl and agentlightning); use trl or auto")
    return "trl", f"ppo.backend=auto fell back to TRL GRPO: {why}"


def resolve_backend(params: Params, params_path: str | None) -> tuple[str, str | None]:
    """:func:`pick_backend` asked of the model plane's interpreter (the control plane has no torch)."""
    if params.ppo.backend == "trl":
        return "trl", None
    import subprocess

    from pipeline.envs import REPO_ROOT, model_python

    probe = ("import json, sys; from pipeline.config import load_params; from pipeline.stages.train_ppo import pick_backend\n"
             "try:\n print(json.dumps(pick_backend(load_params(sys.argv[1] or None))))\n"
             "except RuntimeError as exc:\n print(json.dumps(['error', str(exc)]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([model_python(), "-c", probe, params_path or ""], capture_output=True, text=True, check=False, env=env, timeout=300)
    try:
        backend, why = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as exc:
        raise RuntimeError(f"could not ask the model plane ({model_python()}) for a ppo backend: {out.stderr[-1500:]}") from exc
    if backend == "error":
        raise RuntimeError(why)
    return backend, why


# --- CPU: TRL GRPO on the senior prompts --------------------------------------------------------

def make_reward(params: Params, log: list[dict[str, Any]]) -> Any:
    """The GRPO reward function: one score per sampled completion, recorded with its reason in ``log``."""
    from pipeline.agents.llm import RoleClient
    from pipeline.rewards.senior import completion_text, score

    url, key = os.environ[JUDGE_URL_ENV], os.environ[JUDGE_KEY_ENV]

    calls = itertools.count()

    async def senior_reward(prompts: list[Any], completions: list[Any], agent: list[str], label: list[str], question: list[str],
                            abstract: list[str], task_id: list[str], trainer_state: Any = None, **_: Any) -> list[float]:
        client = RoleClient.for_agents(params.agents, url, key, params.ppo.reward.timeout_s, max_tokens=params.judge.max_tokens)
        try:
            texts = [completion_text(c) for c in completions]
            results = await asyncio.gather(*[
                score(client, params, a, t, {"id": tid, "question": q, "contexts": [ab], "final_decision": lab})
                for a, t, tid, q, ab, lab in zip(agent, texts, task_id, question, abstract, label, strict=True)])
        finally:
            await client.aclose()
        step = int(getattr(trainer_state, "global_step", 0) or 0) + 1
        call = next(calls)  # TRL's batch holds each prompt's group_size completions one after the other
        log.extend({"step": step, "group": f"{call}-{i // params.ppo.group_size}", "task_id": tid, **r, "completion": t[:800]}
                   for i, (tid, r, t) in enumerate(zip(task_id, results, texts, strict=True)))
        return [float(r["value"]) for r in results]

    return senior_reward


def train_trl(params: Params) -> dict[str, Any]:
    """Model plane: GRPO + LoRA, adapter saved atomically, metrics returned."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from pipeline.rewards.senior import SCHEMAS
    from pipeline.rl.guided import GuidedGRPOTrainer, compile_grammars, prompt_key

    cfg = params.ppo
    rows = load_prompts(params)
    budget = max(SCHEMAS[a].token_budget() for a in cfg.agents)
    if cfg.max_completion_tokens < budget:
        raise ValueError(f"ppo.max_completion_tokens={cfg.max_completion_tokens} is below the schema budget of ppo.agents "
                         f"({budget} tokens): completions would be cut into invalid JSON")
    agent_of = {prompt_key(r["prompt"]): r["agent"] for r in rows}
    columns = ("prompt", "agent", "label", "question", "abstract", "task_id")
    train_ds = Dataset.from_list([{k: (r.get(k) or "") if k != "prompt" else r[k] for k in columns} for r in rows])
    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=torch.bfloat16 if gpu else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    lora = cfg.lora
    peft = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type="CAUSAL_LM")
    scored: list[dict[str, Any]] = []
    out = Path(cfg.out_dir)
    with atomic_dir(out) as tmp:
        args = GRPOConfig(output_dir=str(tmp / "checkpoints"), max_steps=cfg.max_steps, per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
                          num_generations=cfg.group_size, max_completion_length=cfg.max_completion_tokens, learning_rate=cfg.learning_rate,
                          beta=cfg.kl_coef, temperature=cfg.temperature, logging_steps=1, save_strategy="no", report_to="none",
                          seed=cfg.seed, data_seed=cfg.seed, bf16=gpu, use_cpu=not gpu, dataloader_num_workers=0, disable_tqdm=False,
                          lr_scheduler_type="constant", warmup_steps=0)
        grammars = compile_grammars(tokenizer, model.config.vocab_size, {a: SCHEMAS[a] for a in cfg.agents})
        trainer = GuidedGRPOTrainer(model=model, reward_funcs=[make_reward(params, scored)], args=args, train_dataset=train_ds,
                                    processing_class=tokenizer, peft_config=peft, grammars=grammars,
                                    agent_of=lambda prompt: agent_of[prompt_key(prompt)])
        t0 = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - t0
        trainer.model.save_pretrained(str(tmp / "adapter"))
        tokenizer.save_pretrained(str(tmp / "adapter"))
        import shutil

        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)
        history = [h for h in trainer.state.log_history if "step" in h]
        write_json(tmp / "log_history.json", history)
        write_text(tmp / "completions.jsonl", "".join(json.dumps(r) + "\n" for r in scored))
        steps = [h for h in history if "reward" in h]
        reasons: dict[str, int] = {}
        for r in scored:
            key = r["reason"].split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        metrics = {"backend": "trl", "algorithm": "grpo", "device": "cuda" if gpu else "cpu", "steps": result.global_step,
                   "prompts": len(rows), "agents": list(cfg.agents), "decoding": "xgrammar JSON schema", **signal(scored),
                   "train_seconds": round(seconds, 2),
                   "seconds_per_step": round(seconds / max(1, result.global_step), 2),
                   "reward_first": steps[0]["reward"] if steps else None, "reward_last": steps[-1]["reward"] if steps else None,
                   "reward_mean": sum(r["value"] for r in scored) / len(scored) if scored else None,
                   "kl_last": next((h["kl"] for h in reversed(steps) if "kl" in h), None),
                   "decision_accuracy": (sum(r["aligned"] is True for r in scored) / n_aligned
                                         if (n_aligned := sum(r.get("aligned") is not None for r in scored)) else None),
                   "reward_reasons": reasons, "base_model": str(Path(cfg.base_model).resolve())}
        write_json(tmp / "train_meta.json", metrics)
    return metrics


# --- GPU: verl through Agent Lightning --------------------------------------------------------------

def _relay(stream: Any, secrets_: list[str]) -> None:
    """Print the trainer's output line by line with the gateway key masked: Agent Lightning's task runner
    pprints the resolved config, and the key is in it (its trainer reads it there)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        for secret in secrets_:
            line = line.replace(secret, "<redacted>")
        sys.stdout.write(line)
        sys.stdout.flush()


def verl_history(path: Path) -> list[dict[str, Any]]:
    """verl's file logger (``trainer.logger`` ``file``): one ``{"step", "data"}`` line per step -> the curve rows."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        data = rec.get("data", {})
        rows.append({"step": rec["step"], "reward": data.get("critic/rewards/mean", data.get("critic/score/mean")),
                     "kl": data.get("actor/kl_loss"), "entropy": data.get("actor/entropy"), "pg_loss": data.get("actor/pg_loss"),
                     "response_length": data.get("response_length/mean"), "step_seconds": data.get("timing_s/step")})
    return [r for r in rows if r["reward"] is not None]


def verl_signal(recs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Did this run's rollouts carry a learning signal? GRPO's advantage is zero when every reward in a group
    is equal; all rollout rewards equal (or no step logged) means the adapter is the base model."""
    import statistics

    rewards = [float(r["reward"]) for r in recs if r.get("reward") is not None]
    std = statistics.pstdev(rewards) if rewards else None
    reason = (f"verl logged {steps} training steps" if not steps else
              f"{len(rewards)} rollout rewards of this run, all equal (std {std}): every advantage was zero" if not std else None)
    return {"rollouts": len(recs), "valid_fraction": (sum(r.get("status") == "succeeded" for r in recs) / len(recs)) if recs else None,
            "reward_std": std, "reward_mean": statistics.fmean(rewards) if rewards else None,
            "no_signal": reason is not None, "no_signal_reason": reason}


def train_verl(params: Params, run_id: str) -> dict[str, Any]:
    """Control plane: gateway + controller + verl trainer, supervised; the adapter through verl's model merger."""
    import shutil
    import subprocess
    import threading

    from pipeline import gpu_memory
    from pipeline.envs import REPO_ROOT, model_python
    from pipeline.rl import gateway, store
    from pipeline.rl.checkpoint import adapter_from_checkpoint

    cfg = params.ppo
    crowded = gpu_memory.oversubscribed(gpu_memory.plan(params))
    if crowded:  # vLLM would refuse to start after minutes of setup: say it now, the way `preflight gpu` does
        raise RuntimeError("; ".join(crowded) + " (python -m pipeline preflight gpu plans the devices)")
    policy_name = str(Path(cfg.base_model).resolve())  # verl registers its rollout servers under the model path
    ckpt = Path(cfg.out_dir).with_name(Path(cfg.out_dir).name + ".checkpoints").resolve()
    shutil.rmtree(ckpt, ignore_errors=True)  # a previous run's global_step_N must never become this run's adapter
    ckpt.mkdir(parents=True)
    trace_dir = Path(cfg.agl.trace_dir).resolve()
    with gateway.running(params, policy_name, run_id=run_id, trace_dir=trace_dir) as gw:
        env = {**os.environ, "AGL_BASE_URL": gw.url, "AGL_KEY": gw.key, "PUBMEDQA_RL_CHECKPOINTS": str(ckpt),
               store.TRACE_DIR_ENV: str(trace_dir), store.RUN_ENV: run_id, "VERL_FILE_LOGGER_PATH": str(ckpt / "metrics.jsonl"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        argv = [model_python(), "-m", "pipeline.rl.verl_main"] + (["--params", os.environ["PIPELINE_PARAMS"]] if os.environ.get("PIPELINE_PARAMS") else [])
        t0 = time.perf_counter()
        trainer = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        relay = threading.Thread(target=_relay, args=(trainer.stdout, [gw.key]), daemon=True)
        relay.start()
        try:
            while trainer.poll() is None:
                gw.check()  # a dead gateway/controller would leave the trainer waiting for rollouts forever
                time.sleep(5)
        except BaseException:
            import signal

            os.killpg(trainer.pid, signal.SIGTERM)
            trainer.wait(60)
            raise
        finally:
            relay.join(10)
        if trainer.returncode != 0:
            raise RuntimeError(f"verl trainer exited with code {trainer.returncode} (its output is above)")
        seconds = time.perf_counter() - t0
    history = verl_history(ckpt / "metrics.jsonl")
    recs = [r for r in store.records(trace_dir) if r.get("run_id") == run_id]  # this run's rollouts, not every past run's
    with atomic_dir(Path(cfg.out_dir)) as tmp:
        adapter_from_checkpoint(ckpt, tmp / "adapter", model_python())
        steps = len(history)
        metrics = {"backend": "verl", "algorithm": cfg.algorithm, "device": f"cuda x{cfg.gpus}", "steps": steps,
                   "train_seconds": round(seconds, 2), "seconds_per_step": round(seconds / steps, 2) if steps else None,
                   "reward_first": history[0]["reward"] if history else None, "reward_last": history[-1]["reward"] if history else None,
                   "kl_last": next((h["kl"] for h in reversed(history) if h.get("kl") is not None), None),
                   **verl_signal(recs, steps), "base_model": policy_name}
        write_json(tmp / "train_meta.json", metrics)
        write_json(tmp / "log_history.json", history)
    return metrics


# --- control plane: MLflow + registry -------------------------------------------------------------------

def _log_curves(history: list[dict[str, Any]]) -> None:
    from pipeline.plots import png

    rows = [h for h in history if "reward" in h]
    write_text(CURVE_CSV, "step,reward,kl\n" + "".join(f"{h['step']},{h['reward']},{'' if h.get('kl') is None else h['kl']}\n" for h in rows))
    with png(CURVE_PNG) as ax:
        steps = [h["step"] for h in rows]
        ax.plot(steps, [h["reward"] for h in rows], "o-", label="mean reward of sampled completions")
        if any("kl" in h for h in rows):
            ax.plot(steps, [h.get("kl", float("nan")) for h in rows], "s--", label="KL to the base policy")
        ax.set_xlabel("step")
        ax.set_title("senior_researcher GRPO")
        ax.legend()


def log_and_register(params: Params, metrics: dict[str, Any], run: Any) -> Any:
    import mlflow

    from pipeline import registry, tracking

    cfg = params.ppo
    out = Path(cfg.out_dir)
    history = json.loads((out / "log_history.json").read_text())
    _log_curves(history)
    tracking.log_training({**{k: v for k, v in cfg.model_dump().items() if k not in ("lora", "reward", "agl", "verl_overrides")},
                           **{f"lora.{k}": v for k, v in cfg.lora.model_dump().items()},
                           **{f"reward.{k}": v for k, v in cfg.reward.model_dump().items()}, "backend_used": metrics["backend"]},
                          history, metrics, CURVE_PNG)
    if (out / "completions.jsonl").exists():
        scored = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        if scored:
            mlflow.log_table({k: [r.get(k) for r in scored] for k in ("step", "agent", "task_id", "value", "validity", "judge", "aligned", "reason", "completion")},
                             artifact_file="completions.json")
    if metrics.get("no_signal"):  # an adapter trained on zero advantages is the base model: nothing to register or evaluate
        tracking.tag_no_signal(metrics["no_signal_reason"])
        return None
    rows = [{"run_id": r.get("run_id", "")} for r in load_prompts(params)]
    return registry.register_adapter(params, run, cfg.role, out / "adapter", data_dir(params), rows, cfg.base_model,
                                     f"LoRA adapter for the {cfg.role} role (online RL on the society's rollouts)",
                                     backend=metrics["backend"], algorithm=metrics["algorithm"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--in-model-plane", action="store_true", help=argparse.SUPPRESS)


def _summary(m: dict[str, Any]) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"train_ppo [{m['backend']}/{m['algorithm']}/{m['device']}]: {m['steps']} steps, {m['seconds_per_step']} s/step, reward "
            f"{fmt(m.get('reward_first'))} -> {fmt(m.get('reward_last'))} (mean {fmt(m.get('reward_mean'))}), KL {fmt(m.get('kl_last'))}, "
            f"reasons {m.get('reward_reasons', {})}; valid {fmt(m.get('valid_fraction'))}, reward std {fmt(m.get('reward_std'))}, "
            f"{m.get('zero_advantage_groups')}/{m.get('groups')} groups with zero advantage"
            + (f"; NO SIGNAL: {m['no_signal_reason']}" if m.get("no_signal") else ""))


def main(args: argparse.Namespace, params: Params) -> int:
    """Control plane (what the DAG and dvc.yaml run, on any worker): MLflow run, backend, registration.
    ``--in-model-plane`` (said by the control plane, never guessed from what imports) trains with TRL."""
    from pipeline.envs import run_in_model_plane

    if args.in_model_plane:
        try:
            backend, why = pick_backend(params)
            if backend == "verl":
                raise RuntimeError("the verl backend is driven from the control plane (`python -m pipeline train-ppo`)")
            metrics = {**train_trl(params), "fallback_reason": why}
        except (FileNotFoundError, ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        write_json(METRICS_FILE, metrics)
        from pipeline import metrics_files

        metrics_files.write("train_ppo", metrics)
        # the CPU path's training samples are its scored completions: into the RL trace store with them
        import shutil

        from pipeline.io import atomic_path

        with atomic_path(Path(params.ppo.agl.trace_dir) / "grpo-completions.jsonl") as dest:
            shutil.copyfile(Path(params.ppo.out_dir) / "completions.jsonl", dest)
        print(_summary(metrics))
        return 0
    try:  # fail fast, before paying for torch or services, on data that cannot train
        load_prompts(params)
        backend, why = resolve_backend(params, args.params_path)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if why:
        print(f"train_ppo: {why}")
    from pipeline.serving import stack

    url, key = stack.ensure(params)  # the judge scores completions through the proxy
    os.environ[JUDGE_URL_ENV], os.environ[JUDGE_KEY_ENV] = url, os.environ.get("LLM_API_KEY", key)
    argv = (["--params", args.params_path] if args.params_path else []) + ["train-ppo", "--in-model-plane"]
    from pipeline import tracking

    if args.no_mlflow and backend == "trl":
        return run_in_model_plane(argv)
    with tracking.stage_run("train_ppo", params) as run:
        import mlflow

        mlflow.set_tags({"backend": backend, "fallback_reason": why or ""})
        if backend == "verl":
            try:
                metrics = train_verl(params, run.info.run_id)
            except Exception as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            write_json(METRICS_FILE, {**metrics, "fallback_reason": why})
            from pipeline import metrics_files

            metrics_files.write("train_ppo", metrics)
            print(_summary(metrics))
        else:
            rc = run_in_model_plane(argv)
            if rc != 0:
                return rc
        metrics = json.loads(METRICS_FILE.read_text())
        version = log_and_register(params, metrics, mlflow.get_run(run.info.run_id))
        mlflow.log_artifact(str(METRICS_FILE))
        if version is None:
            print(f"train_ppo: no_signal, nothing registered: {metrics['no_signal_reason']}")
        else:
            print(f"registered {params.ppo.role} version {version.version} (models:/{params.ppo.role}/{version.version})")
    return 0
