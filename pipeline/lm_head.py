"""On the CPU, TRL's fused LM head scores only the positions that carry a label, as it does on CUDA.

TRL's trainers (``trl.trainer.utils.add_fused_lm_head``, 1.16) project the hidden states through the LM head in tiles,
and off Triton devices over *every* position, labelled or not: a compiled backend (Neuron) would recompile for each
count of labelled positions. Eager CPU recompiles nothing, and here few positions carry a label: the PI's rows one token
in 100-500, an SFT row its completion, a GRPO row its completion after a longer prompt. Scoring those alone gives the
same log-probabilities, losses and gradients (tests/test_lm_head.py) for less work: a PI step at 0.64x its time
(docs/benchmarks.md). The head is 28M of SmolLM2-135M's 135M parameters, so it was a fifth of every step's FLOPs.
"""

from __future__ import annotations

from typing import Any


def score_labelled_positions_only() -> None:
    """Model plane, before a TRL trainer is built: the fused head's ``compact`` path on the CPU too (idempotent)."""
    import trl.trainer.utils as trl_utils  # noqa: PLC0415 - model plane only

    upstream = trl_utils._use_triton  # the one switch TRL reads for it (pinned: tests/test_lm_head.py)
    if getattr(upstream, "labelled_only", False):
        return

    def compact(device: Any) -> bool:
        return device.type == "cpu" or upstream(device)

    compact.labelled_only = True  # type: ignore[attr-defined]
    trl_utils._use_triton = compact
