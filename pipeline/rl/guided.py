"""GRPO on CPU with completions decoded under each call's JSON schema (model plane only).

The served society decodes every structured answer under its schema (vLLM guided decoding), so an
unconstrained completion from HF ``generate`` is a sample from a policy the society never runs: a
135M model writes prose, the reward parser finds no JSON, every completion of a group scores the
same and GRPO's advantages are all zero (the trainer "learns" from nothing). Here each row of a
generation batch gets a logits processor compiled from its call's schema as the workers compile it
(``pipeline.rl.grammar``: their backend, vLLM's options), so what GRPO samples and updates is the
policy the society serves.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from transformers import LogitsProcessorList
from trl import GRPOTrainer

from pipeline.rl.grammar import Grammars


def prompt_key(prompt: Any) -> str:
    """A dataset row's prompt (messages or text) as a lookup key."""
    return json.dumps(prompt, sort_keys=True, default=str)


class GuidedGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose HF ``generate`` decodes each row under its call's compiled grammar."""

    def __init__(self, *args: Any, grammars: Grammars, grammar_of: Callable[[Any], str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grammars, self._grammar_of = grammars, grammar_of
        self._rows: list[str] = []
        model = self.model
        plain = model.generate

        def generate(*g_args: Any, **g_kwargs: Any) -> Any:
            batch = g_kwargs["input_ids"].shape[0] if "input_ids" in g_kwargs else g_args[0].shape[0]
            if len(self._rows) != batch:
                raise RuntimeError(f"guided generation: {len(self._rows)} grammars for a batch of {batch} prompts")
            guided = self._grammars.processor(self._rows)
            processors = LogitsProcessorList([*(g_kwargs.pop("logits_processor", None) or []), guided])
            return plain(*g_args, logits_processor=processors, **g_kwargs)

        model.generate = generate  # the instance TRL unwraps for generation (no DDP/DeepSpeed wrapper on one CPU process)

    def _generate(self, prompts: list[Any]) -> Any:
        self._rows = [self._grammar_of(p) for p in prompts]
        try:
            return super()._generate(prompts)
        finally:
            self._rows = []
