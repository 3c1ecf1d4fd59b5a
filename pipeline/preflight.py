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
from pipeline.config import Params
from pipeline.envs import REPO_ROOT, model_python
from pipeline.rl import verl_config
from pipeline.serving import routing

GPU_LOCK = REPO_ROOT / "requirements" / "gpu.lock.txt"
STAGE_PACKAGES: dict[str, tuple[str, ...]] = {  # import name -> distribution name is the same for all of these
    "serving": ("vllm",),
    "train_sft": ("torch", "transformers", "peft", "trl", "unsloth"),
    "train_ppo": ("torch", "vllm", "ray", "verl", "agentlightning", "peft"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=["gpu"], help="what to check: gpu (the GPU stages of a profile)")
    parser.add_argument("--params", default=None, help="the profile to check (default: $PIPELINE_PARAMS or params.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print the verl trainer config the profile composes (key redacted)")
    parser.add_argument("--imports", action="store_true", help="also import each GPU stage's packages (run on the GPU worker)")
    parser.add_argument("--if-gpu", action="store_true", help="pass with nothing to check when the profile says no GPU stage (the DAG's CPU runs)")


def gpu_stages(params: Params) -> list[str]:
    """The GPU stages a profile *says* it runs (a backend named, a worker given a GPU share); ``auto`` says nothing."""
    said = [f"ppo.backend={params.ppo.backend}"] if params.ppo.backend == "verl" else []
    said += [f"sft.backend={params.sft.backend}"] if params.sft.backend == "unsloth" else []
    return said + [f"serving.workers[{w.name}].gpu_memory_utilization" for w in params.serving.workers if w.gpu_memory_utilization is not None]


def compose(params: Params) -> Any:
    """The trainer config the profile composes (placeholders for the per-run gateway URL and key)."""
    return verl_config.compose(params, Path(params.ppo.out_dir + ".checkpoints"), "train_ppo", "http://<gateway>", "<per-run key>")


def check_verl(params: Params, config: Any, print_config: bool) -> str:
    if print_config:
        print(verl_config.printable(config))
    broken = verl_config.contract(params, config)
    if broken:
        raise ValueError("; ".join(broken))
    agl, verl = verl_config.config_dirs()
    return f"composed {agl / 'config.yaml'} over {verl} with {len(verl_config.overrides(params, '.', 'x'))} overrides"


def check_verl_validation(config: Any) -> str:
    return verl_config.validate(config, model_python())


def check_memory(params: Params) -> str:
    devices = gpu_memory.plan(params)
    crowded = gpu_memory.oversubscribed(devices)
    if crowded:
        raise ValueError("; ".join(crowded))
    return "; ".join(gpu_memory.describe(devices, params.gpu.device_memory_gib)) or "no local GPU consumer"


def check_routing(params: Params) -> str:
    numbers = routing.versions(params)
    for number in numbers:
        routing.load_version(params, number)  # raises naming a role or a deployment no worker serves
    names = sorted({routing.expected_model(params, w.name) for w in params.serving.workers})
    return f"{len(numbers)} routing version(s) resolve to served models {names}"


def check_serving(params: Params) -> str:
    need = params.ppo.max_prompt_tokens + senior_completion_ceiling(params.agents)
    short = [f"{w.name} max_model_len {w.max_model_len}" for w in params.serving.workers if w.max_model_len < need]
    if short:
        raise ValueError(f"{', '.join(short)} < ppo.max_prompt_tokens + the agents' completion ceiling = {need}")
    return f"every worker's context holds {need} tokens"


def check_evaluation(params: Params) -> str:
    limit, need = params.evaluate.limit, params.promote.min_tasks
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


def check_packages(params: Params, imports: bool) -> str:
    pins = locked()
    wanted = sorted({p for pkgs in STAGE_PACKAGES.values() for p in pkgs} | ({"flash_attn"} if params.ppo.attention == "flash_attention_2" else set()))
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
    return ", ".join(f"{p}=={pins[p.replace('_', '-')]}" for p in wanted) + (" (imported)" if imports else " (pinned; --imports on the worker imports them)")


def main(args: argparse.Namespace, params: Params) -> int:
    if args.if_gpu and not gpu_stages(params):
        print(f"preflight gpu ({args.params_path or 'params.yaml'}): the profile names no GPU stage (backends auto/trl, no GPU worker share): "
              "nothing to check")
        return 0
    config = functools.cache(lambda: compose(params))  # composed once for both verl checks (a failure fails both)
    checks: list[tuple[str, Callable[[], str]]] = [
        ("verl config", lambda: check_verl(params, config(), args.print_config)),
        ("verl validation", lambda: check_verl_validation(config())),
        ("gpu memory", lambda: check_memory(params)),
        ("routing", lambda: check_routing(params)),
        ("serving", lambda: check_serving(params)),
        ("evaluation", lambda: check_evaluation(params)),
        ("packages", lambda: check_packages(params, args.imports)),
    ]
    failed = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}")
        except (ValueError, RuntimeError, routing.RoutingError, verl_config.VerlConfigError) as exc:
            failed += 1
            print(f"FAIL {name}: {exc}")
    print(f"preflight gpu ({args.params_path or 'params.yaml'}): " + (f"{failed} check(s) failed" if failed else "all checks passed"))
    sys.stdout.flush()
    return 1 if failed else 0
