"""train_pi's held-out check (``discrimination``) on both planes' releases: the GPU image's transformers 5.17.0 and the
CPU plane's 5.19.0, each over the pinned peft, and the pinned unsloth's forward read from its source.

``discrimination`` reads one position a question with ``model(input_ids=..., logits_to_keep=1)`` on the trainer's
PEFT model. A release that ignored the keyword would return every position's logits and ``[0, -1]`` would still read
the last one (slower, same figure); one that rejected it would stop ``train_pi`` after training, on the GPU only. So
the figures are checked against a full forward, under each release, and unsloth's patched forwards (which replace
``PeftModelForCausalLM.forward`` and the model's on the GPU; unsloth needs a GPU to import) must name the keyword and
pass it on."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from tests.conftest import GPU_RELEASES, run_in_model_venv, run_with_gpu_releases

CHECK = r"""
import json
import torch
import transformers
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.config import load_params
from pipeline.schemas import Decision
from pipeline.stages.train_pi import decision_token_id, discrimination

prefix = load_params("params.yaml", environ={}).agents.decision.prefix
text = Tokenizer(models.BPE())
text.pre_tokenizer, text.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
text.train_from_iterator([prefix + d.value + '"}' for d in Decision] * 3,
                         trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=text, eos_token="<eos>")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2)
model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
model.train()  # as the trainer leaves it
go, no = (decision_token_id(tokenizer, prefix, d.value) for d in (Decision.GO, Decision.NO_GO))
held = []
for i, label in enumerate(["yes", "no", "maybe", "yes", "no"]):
    asked = tokenizer(f"question {i}: does drug {i} lower the risk?" * (i + 1) + prefix)["input_ids"]
    held.append({"task_id": str(i), "label": label, "input_ids": asked + [go, tokenizer.eos_token_id],
                 "completion_mask": [0] * len(asked) + [1, 1]})
got = discrimination(model, tokenizer, held, prefix)
training_after = model.training
model.eval()
full, kept = [], []
with torch.no_grad():
    for r in held:
        if r["label"] in ("yes", "no"):
            asked = torch.tensor([r["input_ids"][:r["completion_mask"].index(1)]])
            logits = model(input_ids=asked).logits
            full.append(float(logits[0, -1, go] - logits[0, -1, no]))
            kept.append(list(model(input_ids=asked, logits_to_keep=1).logits.shape) + [logits.shape[1]])
print(json.dumps({"transformers": transformers.__version__, "vocab": len(tokenizer), "scores": got["scores"],
                  "full": full, "kept": kept, "labels": got["labels"], "yes": got["yes"], "no": got["no"],
                  "auc": got["auc"], "training_after": training_after}))
"""


@pytest.mark.parametrize(("plane", "release"), [("gpu", "5.17.0"), ("cpu", "5.19.0")])
def test_discrimination_reads_the_last_position_as_a_full_forward_does(plane: str, release: str) -> None:
    run = run_with_gpu_releases if plane == "gpu" else run_in_model_venv
    got: dict[str, Any] = run(["-c", CHECK])
    assert got["transformers"] == release
    assert got["labels"] == ["yes", "no", "yes", "no"] and (got["yes"], got["no"]) == (2, 2)  # maybe is not ranked
    # logits_to_keep=1 honoured: one position's logits, where the prompt has many
    assert all(shape[:2] == [1, 1] and shape[2] == got["vocab"] and length > 1 for *shape, length in got["kept"])
    assert max(abs(a - b) for a, b in zip(got["scores"], got["full"], strict=True)) < 1e-5
    assert len(set(got["scores"])) == 4 and got["auc"] is not None  # random LoRA weights: the questions score apart
    assert got["training_after"]  # the trainer's mode is given back


def _function(name: str) -> ast.FunctionDef:
    path = GPU_RELEASES / "unsloth/models/llama.py"
    assert path.exists(), f"{path} missing: run `make setup` (scripts/setup_envs.sh unpacks requirements/gpu-unpacked.txt)"
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_unsloths_forwards_take_logits_to_keep_and_pass_it_on() -> None:
    """unsloth 2026.10.9 replaces ``PeftModelForCausalLM.forward`` with ``PeftModel_fast_forward`` and the Llama
    model's with ``_CausalLM_fast_forward``: both name ``logits_to_keep`` (not swallowed by ``**kwargs``), the first
    hands it to the second, and the second cuts the hidden states to that many positions before the LM head."""
    peft_forward, model_forward = _function("PeftModel_fast_forward"), _function("_CausalLM_fast_forward")
    for fn in (peft_forward, model_forward):
        assert "logits_to_keep" in [a.arg for a in fn.args.args], fn.name
    passed = {kw.arg: kw.value for call in ast.walk(peft_forward) if isinstance(call, ast.Call) for kw in call.keywords}
    assert isinstance(passed.get("logits_to_keep"), ast.Name) and passed["logits_to_keep"].id == "logits_to_keep"
    cut = ast.unparse(model_forward)
    assert "max(num_logits_to_keep, logits_to_keep)" in cut and "hidden_states[:, -num_logits_to_keep:, :]" in cut
