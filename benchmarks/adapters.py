"""The LoRA adapter the benchmarks hot-load: made by the model plane with peft, shaped like the trained ones.

One builder for every benchmark that needs an adapter, so they all measure the same kind of file. ``init="zero"``
keeps peft's zero B matrices (the adapter answers as the base model does: only the cost differs, which is what
``bench_learning`` compares); ``"random"`` gives B random weights, so an adapter request really multiplies through
the LoRA path and its outputs differ from the base model's (``bench_lora_tax``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Literal

from pipeline.envs import model_python

SCRIPT = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
base, out, rank, modules, init = sys.argv[1:6]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(base)
cfg = LoraConfig(r=int(rank), lora_alpha=2 * int(rank), target_modules=modules.split(","),
                 init_lora_weights=init == "zero")
get_peft_model(model, cfg).save_pretrained(out)
"""


def make_adapter(base: str | Path, out: str | Path, rank: int, modules: list[str],
                 init: Literal["zero", "random"]) -> None:
    """Write a rank-``rank`` adapter on ``modules`` of the model at ``base`` into the folder ``out``."""
    subprocess.run([model_python(), "-c", SCRIPT, str(base), str(out), str(rank), ",".join(modules), init],
                   check=True, timeout=600)
