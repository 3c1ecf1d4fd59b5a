"""On the CPU, TRL's fused LM head scores only the positions that carry a label, as it does on CUDA.

TRL's trainers (``trl.trainer.utils.add_fused_lm_head``, 1.16) project the hidden states through the LM head in tiles,
and off Triton devices over *every* position, labelled or not: a compiled backend (Neuron) would recompile for each
count of labelled positions. Eager CPU recompiles nothing, and here few positions carry a label: the PI's rows one token
in 100-500, an SFT row its completion, a GRPO row its completion after a longer prompt. Scoring those alone gives the
same log-probabilities, losses and gradients (tests/test_lm_head.py) for less work: the head (28M of SmolLM2-135M's
135M parameters, and a 49,152-way softmax at each position it scores) was almost half of a PI step, now 0.54x its time
(docs/benchmarks-lm-head.md).
"""

from __future__ import annotations

from typing import Any


def score_labelled_positions_only() -> None:
    """Model plane, before a TRL trainer is built: the fused head's ``compact`` path on the CPU too (idempotent)."""
    import trl.trainer.utils as trl_utils  # noqa: PLC0415 - model plane only

    upstream = getattr(trl_utils, "_use_triton", None)  # the one switch TRL reads for it (pinned: tests/test_lm_head.py)
    if upstream is None or getattr(upstream, "labelled_only", False):
        return  # TRL 1.15 (the GPU image's) scores the labelled positions on every device: nothing to switch

    def compact(device: Any) -> bool:
        return device.type == "cpu" or upstream(device)

    compact.labelled_only = True  # type: ignore[attr-defined]
    trl_utils._use_triton = compact
