"""The PEFT LoRA adapter of a verl 0.8.0 FSDP run, taken from its newest checkpoint.

Why the model merger: verl 0.8.0 no longer writes ``global_step_N/actor/lora_adapter``. Its workers
(``verl/workers/engine_workers.py``; ``fsdp_workers.py`` is gone) save through
``FSDPCheckpointManager.save_checkpoint`` (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``),
which writes into ``<trainer.default_local_dir>/global_step_N/actor/``:

- ``model_world_size_W_rank_R.pt``: each rank's FSDP state dict, PEFT names
  (``base_model.model.….q_proj.lora_A.default.weight``, ``….base_layer.weight``), base weights included;
- ``optim_world_size_W_rank_R.pt``, ``extra_state_world_size_W_rank_R.pt`` (lr scheduler, RNG);
- ``huggingface/``: the model's config, generation config and tokenizer, no weights;
- ``fsdp_config.json`` (``FSDP_version``, ``world_size``);
- ``lora_train_meta.json`` (``r``, ``lora_alpha``, ``task_type``), only when the model is a PEFT LoRA model.

``RayPPOTrainer._save_checkpoint`` (``verl/trainer/ppo/ray_trainer.py``, which Agent Lightning's trainer
calls) adds ``global_step_N/data.pt`` (the dataloader's state) and, once the step is completely saved,
writes N to ``<default_local_dir>/latest_checkpointed_iteration.txt`` (not with
``actor.checkpoint.async_save``). A PEFT folder exists only after
``python -m verl.model_merger merge --backend fsdp --local_dir …/global_step_N/actor --target_dir T``:
``BaseModelMerger.save_lora_adapter`` (``verl/model_merger/base_model_merger.py``) writes
``T/lora_adapter/{adapter_config.json,adapter_model.safetensors}`` (next to a full HF model in ``T``,
which we drop). So the merger runs here as a subprocess under the interpreter that has verl: the GPU
worker's, or the model venv's with ``requirements/contract.txt`` (CPU is enough: it loads on CPU).

What the adapter holds, as the merger writes it (kept unchanged):

- the LoRA weights in **bfloat16** (the merger casts every shard to bf16), keys without ``.default``;
- ``r``, ``lora_alpha`` and ``task_type`` from ``lora_train_meta.json``; ``target_modules`` inferred
  from the weights' names; other LoRA settings at PEFT's defaults;
- ``base_model_name_or_path: null``: the merger builds the config from ``peft.LoraConfig`` without a
  model. Serving needs it to name the engine's ``--model``; ``pipeline.registry`` rewrites the field
  when it deploys a version (``_name_base_model``), so nothing is filled in here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.io import atomic_dir

TRACKER = "latest_checkpointed_iteration.txt"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_STEP = re.compile(r"global_step_(\d+)")
_TAIL = 4000  # characters of the merger's output quoted in an error


def latest_checkpoint(checkpoints: Path) -> Path:
    """``global_step_N/actor`` of the newest complete checkpoint under ``checkpoints``.

    verl's tracker file wins when present (the trainer writes it after the whole step is saved, so a
    step folder newer than it is a save that did not finish); without it, the highest N.
    """
    checkpoints = Path(checkpoints)
    tracker = checkpoints / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"{tracker}: {text!r} is not a step number")
        step = checkpoints / f"global_step_{int(text)}"
        if not step.is_dir():
            raise FileNotFoundError(f"{tracker} names step {int(text)}, but {step} does not exist")
        return step / "actor"
    found = sorted((int(m.group(1)), p) for p in checkpoints.glob("global_step_*")
                   if p.is_dir() and (m := _STEP.fullmatch(p.name)))
    if not found:
        raise FileNotFoundError(f"{checkpoints}: verl saved no global_step_* checkpoint (and no {TRACKER})")
    return found[-1][1] / "actor"


def _check_actor(actor: Path) -> None:
    """Fail before the merger, naming the folder, when it cannot yield a LoRA adapter."""
    if not actor.is_dir():
        raise FileNotFoundError(f"{actor}: the checkpoint has no actor folder")
    shards = sorted(actor.glob("model_world_size_*_rank_0.pt"))
    if not (actor / "fsdp_config.json").is_file() or not shards:
        peft = sorted(p.parent.name for p in actor.glob("*/adapter_config.json"))  # a PEFT folder saved beside nothing else
        legacy = (f" It holds only {peft[0]}/, the layout of verl < 0.8 (fsdp_workers.py), which verl 0.8.0 never writes."
                  if peft else "")
        raise FileNotFoundError(f"{actor}: not a verl FSDP checkpoint (no fsdp_config.json and model_world_size_*_rank_0.pt for "
                                f"verl.model_merger --backend fsdp).{legacy}")
    if not (actor / "lora_train_meta.json").is_file():
        raise ValueError(f"{actor}: a full fine-tune checkpoint (no lora_train_meta.json, so the actor was not a LoRA model): "
                         "ppo.full_finetune runs produce a full model, not an adapter; merge it with "
                         f"`python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir DIR`")


def _merge(python: str, actor: Path, target: Path, timeout_s: float) -> None:
    argv = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
            "--target_dir", str(target)]
    # everything it reads is in the checkpoint (offline); unbuffered, so a killed merger still leaves its last lines
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        raise RuntimeError(f"verl model merger on {actor} timed out after {timeout_s:g}s (killed); "
                           f"its output ended:\n{out[-_TAIL:]}") from None
    except OSError as e:
        raise RuntimeError(f"verl model merger could not start under {python}: {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"verl model merger on {actor} failed (exit {done.returncode}): {' '.join(argv)}\n"
                           f"its output ended:\n{done.stdout[-_TAIL:]}")


def adapter_from_checkpoint(checkpoints: Path, dest: Path, python: str, *, timeout_s: float = 1800.0) -> Path:
    """Merge the newest verl checkpoint under ``checkpoints`` and put its PEFT LoRA adapter at ``dest``.

    ``python`` is an interpreter with verl 0.8.0 (the GPU worker's, or the model venv's). ``dest`` gets
    exactly the merger's ``adapter_config.json`` and ``adapter_model.safetensors`` and appears whole or
    not at all (an existing ``dest`` is replaced). The merger's full-model output goes to a temporary
    folder beside ``dest`` and is removed. Returns the ``global_step_N/actor`` folder that was merged.

    Raises FileNotFoundError (no checkpoint, or not a verl FSDP checkpoint), ValueError (a full
    fine-tune), RuntimeError (the merger failed or timed out, with its output's tail), each naming the folder.
    """
    actor = latest_checkpoint(Path(checkpoints))
    _check_actor(actor)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.merge-", dir=dest.parent) as work:
        target = Path(work) / "merged"
        _merge(python, actor, target, timeout_s)
        found = [p.parent for p in target.glob("*/adapter_config.json")]  # the merger's PEFT folder (verl 0.8.0: lora_adapter/)
        if len(found) != 1:
            raise RuntimeError(f"verl model merger wrote {len(found)} PEFT folders in {target} for {actor}, expected one "
                               "(no lora_ weights in the checkpoint?)")
        adapter = found[0]
        missing = [name for name in ADAPTER_FILES if not (adapter / name).is_file()]
        if missing:
            raise RuntimeError(f"verl model merger wrote no {', '.join(missing)} in {adapter} for {actor}")
        peft_type = json.loads((adapter / "adapter_config.json").read_text()).get("peft_type")
        if peft_type != "LORA":
            raise RuntimeError(f"{adapter}/adapter_config.json from {actor}: peft_type {peft_type!r}, expected 'LORA'")
        with atomic_dir(dest) as out:
            for name in ADAPTER_FILES:
                shutil.move(adapter / name, out / name)
    return actor
