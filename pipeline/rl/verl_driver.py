"""The GPU driver of ``train_ppo``: Agent Lightning's gateway + controller and verl's trainer, supervised.

Runs in the control plane of a GPU worker (the stage's own process): it plans the devices, starts
``agl-server`` and ``agl-controller`` (``pipeline.rl.gateway``), runs ``pipeline.rl.verl_main`` under
the model plane's interpreter with its output relayed (gateway key masked), reads verl's per-step
metrics from its file logger, extracts the adapter through verl's model merger
(``pipeline.rl.checkpoint``) and says whether this run's rollouts carried a signal.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline import envs, gpu_memory
from pipeline.config import GpuParams, PpoRole, ServingParams
from pipeline.io import atomic_dir, write_json
from pipeline.rl import gateway, store
from pipeline.rl.checkpoint import adapter_from_checkpoint


def relay(stream: Any, secrets_: list[str]) -> None:
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
    rewards = [float(r["reward"]) for r in recs if r.get("reward") is not None]
    std = statistics.pstdev(rewards) if rewards else None
    reason = (f"verl logged {steps} training steps" if not steps else
              f"{len(rewards)} rollout rewards of this run, all equal (std {std}): every advantage was zero" if not std else None)
    valid = (sum(r.get("status") == "succeeded" for r in recs) / len(recs)) if recs else None
    return {"rollouts": len(recs), "valid_fraction": valid,
            "reward_std": std, "reward_mean": statistics.fmean(rewards) if rewards else None,
            "no_signal": reason is not None, "no_signal_reason": reason}


def train_verl(ppo: PpoRole, serving: ServingParams, gpu: GpuParams, run_id: str) -> dict[str, Any]:
    """Control plane: gateway + controller + verl trainer, supervised; the adapter through verl's model merger."""
    crowded = gpu_memory.oversubscribed(gpu_memory.plan(serving, ppo, gpu))
    if crowded:  # vLLM would refuse to start after minutes of setup: say it now, the way `preflight gpu` does
        raise RuntimeError("; ".join(crowded) + " (python -m pipeline preflight gpu plans the devices)")
    policy_name = str(Path(ppo.base_model).resolve())  # verl registers its rollout servers under the model path
    ckpt = Path(ppo.out_dir).with_name(Path(ppo.out_dir).name + ".checkpoints").resolve()
    shutil.rmtree(ckpt, ignore_errors=True)  # a previous run's global_step_N must never become this run's adapter
    ckpt.mkdir(parents=True)
    trace_dir = Path(ppo.agl.trace_dir).resolve()
    with gateway.running(ppo.agl, serving, policy_name, ppo.temperature, run_id=run_id, trace_dir=trace_dir,
                         trained=ppo.role) as gw:
        env = {**os.environ, "AGL_BASE_URL": gw.url, "AGL_KEY": gw.key, "PUBMEDQA_RL_CHECKPOINTS": str(ckpt),
               store.TRACE_DIR_ENV: str(trace_dir), store.RUN_ENV: run_id, "VERL_FILE_LOGGER_PATH": str(ckpt / "metrics.jsonl"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(envs.REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        params_file = ["--params", os.environ["PIPELINE_PARAMS"]] if os.environ.get("PIPELINE_PARAMS") else []
        argv = [envs.model_python(), "-m", "pipeline.rl.verl_main", *params_file, "--role", ppo.role]
        t0 = time.perf_counter()
        trainer = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        relaying = threading.Thread(target=relay, args=(trainer.stdout, [gw.key]), daemon=True)
        relaying.start()
        try:
            while trainer.poll() is None:
                gw.check()  # a dead gateway/controller would leave the trainer waiting for rollouts forever
                time.sleep(5)
        except BaseException:
            os.killpg(trainer.pid, signal.SIGTERM)
            trainer.wait(60)
            raise
        finally:
            relaying.join(10)
        if trainer.returncode != 0:
            raise RuntimeError(f"verl trainer exited with code {trainer.returncode} (its output is above)")
        seconds = time.perf_counter() - t0
    history = verl_history(ckpt / "metrics.jsonl")
    recs = [r for r in store.records(trace_dir) if r.get("run_id") == run_id]  # this run's rollouts, not every past run's
    with atomic_dir(Path(ppo.out_dir)) as tmp:
        adapter_from_checkpoint(ckpt, tmp / "adapter", envs.model_python())
        steps = len(history)
        metrics = {"backend": "verl", "algorithm": ppo.algorithm, "device": f"cuda x{ppo.gpus}", "steps": steps,
                   "train_seconds": round(seconds, 2), "seconds_per_step": round(seconds / steps, 2) if steps else None,
                   "reward_first": history[0]["reward"] if history else None,
                   "reward_last": history[-1]["reward"] if history else None,
                   "kl_last": next((h["kl"] for h in reversed(history) if h.get("kl") is not None), None),
                   **verl_signal(recs, steps), "base_model": policy_name}
        write_json(tmp / "train_meta.json", metrics)
        write_json(tmp / "log_history.json", history)
    return metrics
