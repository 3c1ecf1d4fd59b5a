"""verl 0.8.0 checkpoint -> PEFT adapter (pipeline.rl.checkpoint), against a checkpoint verl itself wrote.

The checkpoint is real: verl's own ``FSDPCheckpointManager.save_checkpoint`` on a PEFT LoRA model
wrapped in FSDP (verl's wrap policy, device mesh and sharding strategy), under a world-size-1 gloo
process group on CPU, in the model venv (CPU torch + verl from requirements/contract.txt). Two
deviations from verl's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``), both because
there is no GPU: ``sync_module_states=False`` (FSDP requires GPU tensors to broadcast; with one rank
there is nothing to broadcast) and fp32 mixed precision instead of bf16. ``latest_checkpointed_iteration.txt``
is written the way ``RayPPOTrainer._save_checkpoint`` writes it after a save; the trainer itself (Ray,
vLLM) is not run. The LoRA weights are set to random values before saving, as training would leave them.

The model is the project's tiny random-weight test model, built by ``materialize_model.build_test``
with params.yaml's ``models.test`` dims; its tokenizer is a small stand-in, because the real one comes
from ``models/base`` (materialised from a GGUF: slow, and absent in a fresh checkout).
The user's check runs in the model venv: the adapter loads with ``peft.PeftModel.from_pretrained``
onto that base model, its LoRA weights equal the checkpoint's (bf16, as the merger writes them), and
it changes the model's output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import load_params
from pipeline.envs import model_python
from pipeline.rl.checkpoint import ADAPTER_FILES, TRACKER, adapter_from_checkpoint, latest_checkpoint
from tests.conftest import ROOT

BUILD = r"""
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

spec = json.loads(sys.argv[1])
root = Path(spec["root"])
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from pipeline.config import TestModelParams
from pipeline.stages.materialize_model import build_test

# stand-in for models/base: a SmolLM2-shaped Llama config (tied embeddings) and a small tokenizer with a chat template
words = ["<unk>", "<|im_start|>", "<|im_end|>", *[chr(c) for c in range(33, 127)], "yes", "no", "maybe", "user", "assistant"]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>")
fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
fast.save_pretrained(root / "base")
LlamaConfig(vocab_size=len(words), hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=1536, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            architectures=["LlamaForCausalLM"]).save_pretrained(root / "base")
tiny = str(root / "tiny")
build_test(TestModelParams(**{**spec["test_model"], "out_dir": tiny}), str(root / "base"))

dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
from omegaconf import OmegaConf
from peft import LoraConfig, TaskType, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import get_fsdp_wrap_policy
from verl.workers.engine.fsdp.utils import create_device_mesh, get_sharding_strategy

mesh = create_device_mesh(world_size=1, fsdp_size=-1)
contents = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"]})


def save(ckpt, step, lora):
    module = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    if lora:  # verl's _build_lora_module
        module.enable_input_require_grads()
        module = get_peft_model(module, LoraConfig(task_type=TaskType.CAUSAL_LM, r=lora["r"], lora_alpha=lora["alpha"],
                                                   target_modules=lora["target_modules"], bias="none"))
        torch.manual_seed(step)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if "lora_" in name:
                    p.normal_(std=0.05)
        save_file({k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module).items()},
                  str(root / f"expected-{step}.safetensors"))
    fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    fsdp = FSDP(module, auto_wrap_policy=get_fsdp_wrap_policy(module=module, config=None, is_lora=bool(lora)),
                device_id=torch.device("cpu"), sharding_strategy=get_sharding_strategy(mesh), mixed_precision=fp32,
                sync_module_states=False, device_mesh=mesh, use_orig_params=False)
    optim = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=1e-5)
    manager = FSDPCheckpointManager(model=fsdp, optimizer=optim, lr_scheduler=None,
                                    processing_class=AutoTokenizer.from_pretrained(tiny), checkpoint_config=contents)
    manager.save_checkpoint(local_path=str(ckpt / f"global_step_{step}" / "actor"), global_step=step)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))  # RayPPOTrainer._save_checkpoint, after the save


for step in (2, 10):
    save(root / "lora", step, spec["lora"])
save(root / "full", 1, None)
dist.destroy_process_group()
"""

CHECK = r"""
import json, sys
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

base_dir, adapter, expected, other = sys.argv[1:5]
ids = torch.tensor([[1, 40, 41, 42, 43, 2]])
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
with torch.no_grad():
    before = base(ids).logits
model = PeftModel.from_pretrained(base, adapter).eval()
with torch.no_grad():
    after = model(ids).logits
loaded = get_peft_model_state_dict(model)
want, not_want = load_file(expected), load_file(other)
with safe_open(f"{adapter}/adapter_model.safetensors", "pt") as f:
    dtypes = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
print(json.dumps({
    "keys_equal": sorted(loaded) == sorted(want),
    "n": len(loaded),
    "equal_bf16": all(torch.equal(loaded[k].float(), want[k].bfloat16().float()) for k in want),
    "max_abs_vs_fp32": max(float((loaded[k].float() - want[k]).abs().max()) for k in want),
    "equals_other_step": all(torch.equal(loaded[k].float(), not_want[k].bfloat16().float()) for k in want),
    "file_dtypes": dtypes,
    "output_changed": not torch.allclose(before, after),
    "peft_type": str(model.peft_config["default"].peft_type),
}))
"""


def _python_with_verl() -> str:
    try:
        python = model_python()
    except RuntimeError as e:
        pytest.skip(f"model venv missing: {e}")
    if not os.access(python, os.X_OK):
        pytest.skip(f"model venv missing: {python} is not an executable (run scripts/setup_envs.sh)")
    found = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('verl') is None)"], check=False)
    if found.returncode != 0:
        pytest.skip(f"verl not installed under {python}: run scripts/setup_envs.sh (installs requirements/contract.txt)")
    return python


def _run(python: str, code: str, *args: str, timeout: float = 180) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert done.returncode == 0, f"{python} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tiny model + real verl checkpoints: lora/global_step_{2,10} (tracker 10) and full/global_step_1 (no LoRA)."""
    python = _python_with_verl()
    params = load_params(ROOT / "params.yaml", environ={})
    root = tmp_path_factory.mktemp("verl")
    spec = {"root": str(root), "test_model": params.models.test.model_dump(),
            "lora": {"r": params.ppo.lora.r, "alpha": params.ppo.lora.alpha, "target_modules": list(params.ppo.lora.target_modules)}}
    _run(python, BUILD, json.dumps(spec))
    return {"python": python, "root": root, "lora": spec["lora"], "layers": params.models.test.layers}


def test_adapter_from_a_real_verl_checkpoint_loads_with_peft(verl_run: dict[str, Any], tmp_path: Path) -> None:
    root: Path = verl_run["root"]
    actor = root / "lora" / "global_step_10" / "actor"
    assert sorted(p.name for p in actor.iterdir()) == [  # verl 0.8.0's layout: no lora_adapter/ any more
        "extra_state_world_size_1_rank_0.pt", "fsdp_config.json", "huggingface", "lora_train_meta.json",
        "model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"]
    dest = tmp_path / "ppo" / "adapter"
    assert adapter_from_checkpoint(root / "lora", dest, verl_run["python"]) == actor  # the tracker's step, the newest
    assert sorted(p.name for p in dest.iterdir()) == sorted(ADAPTER_FILES)
    assert [p.name for p in dest.parent.iterdir()] == ["adapter"]  # the merger's full-model output is gone
    cfg = json.loads((dest / "adapter_config.json").read_text())
    lora = verl_run["lora"]
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", "CAUSAL_LM", lora["r"], lora["alpha"])
    assert sorted(cfg["target_modules"]) == sorted(lora["target_modules"])
    assert cfg["base_model_name_or_path"] is None  # as the merger writes it; pipeline.registry names the served model on deploy

    out = json.loads(_run(verl_run["python"], CHECK, str(root / "tiny"), str(dest),
                          str(root / "expected-10.safetensors"), str(root / "expected-2.safetensors")).splitlines()[-1])
    assert out["keys_equal"] and out["n"] == verl_run["layers"] * len(lora["target_modules"]) * 2, out  # lora_A + lora_B each
    assert out["equal_bf16"] and out["max_abs_vs_fp32"] < 1e-3, out
    assert not out["equals_other_step"] and out["output_changed"] and out["file_dtypes"] == ["torch.bfloat16"], out


def test_full_finetune_checkpoint_is_refused(verl_run: dict[str, Any], tmp_path: Path) -> None:
    actor = verl_run["root"] / "full" / "global_step_1" / "actor"
    assert (actor / "model_world_size_1_rank_0.pt").exists() and not (actor / "lora_train_meta.json").exists()
    with pytest.raises(ValueError, match=rf"{re.escape(str(actor))}: a full fine-tune checkpoint \(no lora_train_meta.json"):
        adapter_from_checkpoint(verl_run["root"] / "full", tmp_path / "adapter", verl_run["python"])
    assert not (tmp_path / "adapter").exists()


def test_merger_failure_and_timeout_report_the_folder_and_output(verl_run: dict[str, Any], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(verl_run["root"] / "lora" / "global_step_10", ckpt / "global_step_10")
    shard = ckpt / "global_step_10" / "actor" / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:1000])  # a truncated shard, as a full disk would leave it
    with pytest.raises(RuntimeError, match=r"(?s)verl model merger on .*global_step_10/actor failed \(exit 1\).*output ended:.*Error"):
        adapter_from_checkpoint(ckpt, tmp_path / "out" / "adapter", verl_run["python"])
    with pytest.raises(RuntimeError, match=r"timed out after 0.01s"):
        adapter_from_checkpoint(ckpt, tmp_path / "out" / "adapter", verl_run["python"], timeout_s=0.01)
    assert list((tmp_path / "out").iterdir()) == []  # neither a partial adapter nor the merger's scratch folder


def test_no_checkpoint_names_the_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(folder))}: verl saved no global_step_\* checkpoint"):
            adapter_from_checkpoint(folder, tmp_path / "adapter", sys.executable)
    assert not (tmp_path / "adapter").exists()


def test_legacy_lora_adapter_layout_alone_is_refused(tmp_path: Path) -> None:
    """verl < 0.8 (fsdp_workers.py) wrote global_step_N/actor/lora_adapter; 0.8.0 never does, and nothing here merges it."""
    legacy = tmp_path / "ckpt" / "global_step_1" / "actor" / "lora_adapter"
    legacy.mkdir(parents=True)
    (legacy / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (legacy / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(legacy.parent))}: not a verl FSDP checkpoint .* layout of verl < 0.8"):
        adapter_from_checkpoint(tmp_path / "ckpt", tmp_path / "adapter", sys.executable)
    assert not (tmp_path / "adapter").exists()


def test_latest_checkpoint_prefers_verls_tracker_then_the_highest_step(tmp_path: Path) -> None:
    for name in ("global_step_2", "global_step_10", "global_step_x", "other"):
        (tmp_path / name / "actor").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_10" / "actor"  # numeric, not lexicographic
    (tmp_path / TRACKER).write_text("2")  # step 10's save never finished: the trainer did not move the tracker
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_2" / "actor"
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(FileNotFoundError, match="names step 7"):
        latest_checkpoint(tmp_path)
    (tmp_path / TRACKER).write_text("seven")
    with pytest.raises(ValueError, match="is not a step number"):
        latest_checkpoint(tmp_path)
