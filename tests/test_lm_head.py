"""TRL's fused LM head scoring only the labelled positions on the CPU (pipeline.lm_head), in the model venv with the
pinned TRL: the same per-token log-probabilities, loss and LoRA gradients as TRL's every-position path, from fewer rows
through the head; with the GPU image's TRL (1.15: the labelled positions on every device) the call changes nothing."""

from __future__ import annotations

from typing import Any

from tests.conftest import run_in_model_venv, run_with_gpu_releases

CHECK = r"""
import inspect, json
import torch
import trl
import trl.trainer.utils as trl_utils
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.lm_head import score_labelled_positions_only

# the switch the patch sets is the one the pinned TRL reads for its compact path
switch = "compact = _use_triton(hidden_states.device)" in inspect.getsource(trl_utils.add_fused_lm_head)
rows = []
apply = trl_utils._ChunkedLogProbFunction.apply
trl_utils._ChunkedLogProbFunction.apply = staticmethod(lambda hidden, *a: (rows.append(hidden.shape[0]), apply(hidden, *a))[1])

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
ids = torch.randint(0, 512, (2, 40))
labels = torch.full_like(ids, -100)
labels[0, 30:34], labels[1, 38:] = ids[0, 30:34], ids[1, 38:]  # an answer of 4 tokens, one of 2


def step():
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


full, full_grads = step()
score_labelled_positions_only()
score_labelled_positions_only()  # idempotent: one wrapper, not two
labelled, labelled_grads = step()
print(json.dumps({
    "trl": trl.__version__, "switch": switch,
    "rows": rows,
    "loss": [float(full.loss), float(labelled.loss)],
    "log_probs_max_diff": float((full.log_probs - labelled.log_probs).abs().max()),
    "entropy_max_diff": float((full.entropy - labelled.entropy).abs().max()),
    "top1_equal": bool(torch.equal(full.is_top1, labelled.is_top1)),
    "grad_max_rel": max(float((full_grads[n] - labelled_grads[n]).norm() / full_grads[n].norm()) for n in full_grads),
    "grads": len(full_grads),
}))
"""


def _same(got: dict[str, Any]) -> None:
    assert abs(got["loss"][0] - got["loss"][1]) < 1e-6 * abs(got["loss"][0])
    assert got["log_probs_max_diff"] < 1e-5 and got["entropy_max_diff"] < 1e-5 and got["top1_equal"]
    assert got["grads"] == 8 and got["grad_max_rel"] < 1e-5  # q and v LoRA A/B on both layers moved alike


def test_cpu_head_scores_only_labelled_positions_with_the_same_loss_and_gradients() -> None:
    got = run_in_model_venv(["-c", CHECK])
    # TRL's own path sends every shifted position through the head (2 x 39); the patched one the 6 labelled ones
    assert got["switch"] and got["rows"] == [78, 6]
    _same(got)


NO_OP = r"""
import inspect, json
import trl
import trl.trainer.utils as trl_utils
from pipeline.lm_head import score_labelled_positions_only

before = dict(vars(trl_utils))
score_labelled_positions_only()
print(json.dumps({"trl": trl.__version__, "unchanged": dict(vars(trl_utils)) == before,
                  "labelled_only": "hidden_states[mask],\n" in inspect.getsource(trl_utils.add_fused_lm_head)}))
"""


def test_gpu_image_trl_already_scores_labelled_positions_and_the_call_changes_nothing() -> None:
    # its kernels need a GPU (Triton), so the source says what it scores; training there calls this same function
    got = run_with_gpu_releases(["-c", NO_OP])
    assert got == {"trl": "1.15.0", "unchanged": True, "labelled_only": True}
