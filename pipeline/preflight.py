"""``python -m pipeline preflight gpu``: check a GPU profile before a GPU job, on any machine, no GPU needed.

Every check prints PASS or FAIL with its reason; any FAIL exits 1, so the DAG's preflight task stops
the GPU tasks before they hold a GPU for minutes and fail (docs/gpu.md):

- ``verl config``: the trainer's full config, composed from Agent Lightning's verl config and the
  project's overrides against the *installed* verl (unknown keys fail), keeps LightningRL's loss and
  advantage, LoRA merged for serving during RL, no resume, a response budget that covers the agents;
- ``verl validation``: verl's own ``validate_config`` (batch sizes against GPUs, micro batches, the
  actor and rollout dataclasses) accepts it, run under the model plane's interpreter;
- ``gpu memory``: serving workers + verl's rollout engine + actor per device fit;
- ``routing``: every tracked routing version names deployments the profile's workers serve;
- ``serving``: each worker's context holds a senior prompt and its longest answer;
- ``evaluation``: the gate sees at least ``promote.min_tasks`` tasks, or it can never promote;
- ``packages``: what each GPU stage imports is pinned in the GPU image's lock (``--imports``: and
  imports here, run on the GPU worker itself).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import gpu_memory
from pipeline.agents.llm import senior_completion_ceiling
from pipeline.config import (
    AgentsParams,
    EvaluateParams,
    GpuParams,
    JudgeParams,
    MlflowParams,
    Params,
    PpoRole,
    PpoSettings,
    PromoteParams,
    ServingParams,
    SftParams,
    WorkerParams,
)
from pipeline.envs import REPO_ROOT, model_python
from pipeline.learning import WAYS, Learning
from pipeline.rl import verl_config
from pipeline.serving import routing

TRACKING = False  # python -m pipeline: checks a profile offline; the CLI starts no tracking server for it

GPU_LOCK = REPO_ROOT / "requirements" / "gpu.lock.txt"
# import name -> distribution name is the same for all of these; a kind of learning says its own (pipeline/learning.py)
STAGE_PACKAGES: dict[str, tuple[str, ...]] = {"serving": ("vllm",),
                                              **{k.stage: w.gpu_packages for k, w in WAYS.items() if w.gpu_packages}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=["gpu"], help="what to check: gpu (the GPU stages of a profile)")
    parser.add_argument("--params", default=None, help="the profile to check (default: $PIPELINE_PARAMS or params.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the verl trainer config the profile composes (key redacted)")
    parser.add_argument("--imports", action="store_true", help="also import each GPU stage's packages (run on the GPU worker)")
    parser.add_argument("--if-gpu", action="store_true",
                        help="pass with nothing to check when the profile says no GPU stage (the DAG's CPU runs)")


def gpu_stages(ppo: PpoSettings, sft: SftParams, serving: ServingParams) -> list[str]:
    """The GPU stages a profile *says* it runs (a backend named, a worker given a GPU share); ``auto`` says nothing."""
    said = [f"ppo.backend={ppo.backend}"] if ppo.backend == "verl" else []
    said += [f"sft.backend={sft.backend}"] if sft.backend == "unsloth" else []
    return said + [f"serving.workers[{w.name}].gpu_memory_utilization" for w in serving.workers if w.on_gpu]


def compose(ppo: PpoRole, mlflow: MlflowParams, judge: JudgeParams, worker: WorkerParams) -> Any:
    """The trainer config the profile composes for one role (placeholders for the per-run gateway URL and key)."""
    return verl_config.compose(ppo, mlflow, judge, worker, Path(ppo.out_dir + ".checkpoints"), f"train_ppo@{ppo.role}",
                               "http://<gateway>", "<per-run key>")


def check_verl(ppo: PpoSettings, mlflow: MlflowParams, agents: AgentsParams, worker: WorkerParams, config: Any,
               print_config: bool) -> str:
    if print_config:
        print(verl_config.printable(config))
    broken = verl_config.contract(ppo, agents, worker, config)
    if broken:
        raise ValueError("; ".join(broken))
    agl, verl = verl_config.config_dirs()
    count = len(verl_config.overrides(ppo, mlflow, ".", "x", worker))
    return f"composed {agl / 'config.yaml'} over {verl} with {count} overrides"


def check_verl_validation(config: Any) -> str:
    return verl_config.validate(config, model_python())


def check_memory(serving: ServingParams, ppo: PpoSettings, gpu: GpuParams) -> str:
    devices = gpu_memory.plan(serving, ppo, gpu)
    crowded = gpu_memory.oversubscribed(devices)
    if crowded:
        raise ValueError("; ".join(crowded))
    return "; ".join(gpu_memory.describe(devices, gpu.device_memory_gib)) or "no local GPU consumer"


def check_routing(serving: ServingParams) -> str:
    numbers = routing.versions(serving)
    for number in numbers:
        routing.load_version(serving, number)  # raises naming a role or a deployment no worker serves
    names = sorted({routing.expected_model(serving, w.name) for w in serving.workers})
    return f"{len(numbers)} routing version(s) resolve to served models {names}"


def check_serving(ppo: PpoSettings, agents: AgentsParams, serving: ServingParams) -> str:
    need = ppo.max_prompt_tokens + senior_completion_ceiling(agents)
    short = [f"{w.name} max_model_len {w.max_model_len}" for w in serving.workers if w.max_model_len < need]
    if short:
        raise ValueError(f"{', '.join(short)} < ppo.max_prompt_tokens + the agents' completion ceiling = {need}")
    return f"every worker's context holds {need} tokens"


def check_evaluation(evaluate: EvaluateParams, promote: PromoteParams) -> str:
    limit, need = evaluate.limit, promote.min_tasks
    if limit is not None and limit < need:
        raise ValueError(f"evaluate.limit={limit} < promote.min_tasks={need}: every decision would be insufficient_evidence")
    return f"evaluate.limit={limit or 'the whole split'} >= promote.min_tasks={need}"


def locked() -> dict[str, str]:
    if not GPU_LOCK.exists():
        raise ValueError(f"{GPU_LOCK}: no GPU lock (make lock-gpu)")
    pins = {}
    for line in GPU_LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;#]+)", line.strip())
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1).split("[")[0]).lower()] = m.group(2)
    return pins


def check_packages(ppo: PpoSettings, imports: bool) -> str:
    pins = locked()
    flash = {"flash_attn"} if ppo.attention == "flash_attention_2" else set()
    wanted = sorted({p for pkgs in STAGE_PACKAGES.values() for p in pkgs} | flash)
    missing = [p for p in wanted if p.replace("_", "-") not in pins]
    if missing:
        raise ValueError(f"not pinned in {GPU_LOCK.name}: {', '.join(missing)}")
    if imports:
        broken = []
        for name in wanted:
            try:
                importlib.import_module(name)
            except Exception as exc:  # unsloth raises NotImplementedError without a GPU, others RuntimeError
                broken.append(f"{name} ({type(exc).__name__}: {str(exc)[:120]})")
        if broken:
            raise ValueError("do not import: " + "; ".join(broken))
    return (", ".join(f"{p}=={pins[p.replace('_', '-')]}" for p in wanted)
            + (" (imported)" if imports else " (pinned; --imports on the worker imports them)"))


# whole Params: the role's PPO settings and the mlflow, judge and agents sections the verl config composes from
def _verl_checks(params: Params, role: str, print_config: bool) -> list[tuple[str, Callable[[], str]]]:
    ppo = params.ppo.at(role)  # the settings the config is composed from are the ones its contract is checked against
    worker = params.serving.decoding
    config = functools.cache(lambda: compose(ppo, params.mlflow, params.judge, worker))  # one for both checks
    return [(f"verl config ({role})", lambda: check_verl(ppo, params.mlflow, params.agents, worker, config(), print_config)),
            (f"verl validation ({role})", lambda: check_verl_validation(config()))]


def main(args: argparse.Namespace, params: Params) -> int:
    profile = args.params_path or "params.yaml"
    if args.if_gpu and not gpu_stages(params.ppo, params.sft, params.serving):
        print(f"preflight gpu ({profile}): the profile names no GPU stage (backends auto/trl, no GPU worker share): "
              "nothing to check")
        return 0
    checks: list[tuple[str, Callable[[], str]]] = []
    for role in params.learners()[Learning.PPO]:  # every role that learns by RL: its own trainer config
        checks += _verl_checks(params, role, args.print_config)
    checks += [
        ("gpu memory", lambda: check_memory(params.serving, params.ppo, params.gpu)),
        ("routing", lambda: check_routing(params.serving)),
        ("serving", lambda: check_serving(params.ppo, params.agents, params.serving)),
        ("evaluation", lambda: check_evaluation(params.evaluate, params.promote)),
        ("packages", lambda: check_packages(params.ppo, args.imports)),
    ]
    failed = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}")
        except (ValueError, RuntimeError, routing.RoutingError, verl_config.VerlConfigError) as exc:
            failed += 1
            print(f"FAIL {name}: {exc}")
    print(f"preflight gpu ({profile}): " + (f"{failed} check(s) failed" if failed else "all checks passed"))
    sys.stdout.flush()
    return 1 if failed else 0
