"""Parse vLLM command lines with the GPU image's own vLLM release (run by tests/test_vllm_gpu_argv.py).

Run with the model venv's python and the unpacked release first on PYTHONPATH (.venv/gpu-unpacked,
requirements/gpu-unpacked.txt). Reads {"api_server": [argv, ...], "serve": [argv, ...]} on stdin: ``api_server``
argvs are what follows ``python -m vllm.entrypoints.openai.api_server`` (the local workers' launcher, parsed as its
``__main__`` parses them), ``serve`` argvs what follows the stock image's ``vllm serve`` entrypoint (compose, Kubernetes),
parsed by the ``serve`` subcommand's parser. Both then go through ``validate_parsed_serve_args``, as at startup.
``verl_rollout`` names composed trainer configs (YAML files): for each, the rollout server's engine arguments as
verl 0.8.0's ``vLLMHttpServer.launch_server`` builds them (its ``RolloutConfig``, ``engine_kwargs.vllm``,
``build_cli_args_from_config``), parsed by the ``serve`` parser verl hands them to.
Prints, per argv, either the parsed values the tests check or the parser's error.

The parser needs a platform to compute its defaults. CUDA's cannot load here (its kernels need libcuda), so the
release's CPU platform stands in: it changes defaults only, not which flags exist or how their values parse.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

import vllm
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()  # see the module docstring

from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

FIELDS = ("model", "served_model_name", "port", "max_model_len", "enable_lora", "max_lora_rank", "max_loras",
          "lora_target_modules", "enable_chunked_prefill", "max_num_batched_tokens", "gpu_memory_utilization",
          "enforce_eager", "dtype", "middleware", "lora_modules", "structured_outputs_config")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, object]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except SystemExit:
        return {"error": err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"}
    except Exception as exc:  # validate_parsed_serve_args raises TypeError/ValueError on bad combinations
        return {"error": f"{type(exc).__name__}: {exc}"}
    values = {f: getattr(args, f, None) for f in FIELDS}
    values["lora_modules"] = [{"name": m.name, "path": m.path} for m in values["lora_modules"] or []]
    so = values["structured_outputs_config"]
    values["structured_outputs_config"] = None if so is None else {"backend": getattr(so, "backend", None),
                                                                   "disable_any_whitespace": getattr(so, "disable_any_whitespace", None)}
    return values


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The release's parsers: ``api_server`` as its launcher's ``__main__`` builds it, ``serve`` the CLI subcommand's."""
    top = FlexibleArgumentParser(prog="vllm")
    return {"api_server": make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server.")),
            "serve": ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))}


def verl_rollout_argv(path: str) -> list[str]:
    """What follows ``serve`` in verl's rollout server for the trainer config at ``path`` (engine_kwargs only: the rest
    verl builds from its own rollout fields, which the project does not set through vLLM)."""
    from omegaconf import OmegaConf  # noqa: PLC0415 - only this request needs verl
    from verl.utils.config import omega_conf_to_dataclass  # noqa: PLC0415
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config  # noqa: PLC0415

    config = OmegaConf.load(path)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    engine_kwargs = rollout.get("engine_kwargs", {}).get("vllm", {}) or {}  # as launch_server reads them
    return [config.actor_rollout_ref.model.path,
            *build_cli_args_from_config({k: v for k, v in engine_kwargs.items() if v is not None})]


def main() -> None:
    request = json.load(sys.stdin)
    ps = parsers()
    out = {"version": vllm.__version__,
           "api_server": [parse(ps["api_server"], argv) for argv in request.get("api_server", [])],
           "serve": [parse(ps["serve"], argv) for argv in request.get("serve", [])],
           "verl_rollout": [parse(ps["serve"], verl_rollout_argv(path)) for path in request.get("verl_rollout", [])]}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
