"""What verl 0.8.0 needs in every Ray worker process of ``train_ppo`` (``worker_process_setup_hook``).

- Agent Lightning's own hook (``per_rollout_mean`` loss registered, vLLM compatibility patches):
  Agent Lightning sets it only when no hook is configured, so ours must call it.
- **Pure-torch padding helpers when flash-attn is absent.** verl 0.8.0's trainer unpads every batch
  (``ray_trainer._compute_old_log_prob`` -> ``workers/utils/padding.left_right_2_no_padding`` ->
  ``utils/attention_utils.unpad_input``), and on any non-NPU device ``attention_utils`` imports
  ``flash_attn.bert_padding``: without flash-attn the first step dies with ``No module named
  'flash_attn'``, whatever attention the model uses. PyPI has flash-attn only as a source build for
  torch 2.11 / CUDA 13 (requirements/gpu.in), so the image has none; verl ships the same four helpers
  in pure torch (``verl.utils.npu_flash_attn_utils``), which this module routes ``attention_utils`` to.
"""

from __future__ import annotations

import importlib.util


def use_torch_padding() -> bool:
    """Route verl's padding helpers to its pure-torch ones when flash-attn is not installed; True when it did."""
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    from verl.utils import attention_utils  # noqa: PLC0415 - model plane only (verl's utils import torch)
    from verl.utils import npu_flash_attn_utils as torch_impl  # noqa: PLC0415 - as above

    helpers = (torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange, torch_impl.unpad_input)
    attention_utils._get_attention_functions = lambda: helpers
    return True


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for verl's workers (named in ``pipeline.rl.verl_config.overrides``)."""
    from agentlightning.verl.per_rollout_loss import register_in_worker  # noqa: PLC0415 - model plane only (imports torch)

    register_in_worker()
    use_torch_padding()
