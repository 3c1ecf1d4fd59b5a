"""GRPO on CPU with completions decoded under each call's JSON schema (model plane only).

The served society decodes every structured answer under its schema (vLLM guided decoding), so an
unconstrained completion from HF ``generate`` is a sample from a policy the society never runs: a
135M model writes prose, the reward parser finds no JSON, every completion of a group scores the
same and GRPO's advantages are all zero (the trainer "learns" from nothing). Here each row of a
generation batch gets an xgrammar logits processor compiled from its call's schema, the same
grammar engine vLLM uses, so what GRPO samples and updates is the policy the society serves.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from transformers import LogitsProcessorList
from trl import GRPOTrainer

from pipeline.schemas import StructuredOutput


def prompt_key(prompt: Any) -> str:
    """A dataset row's prompt (messages or text) as a lookup key."""
    return json.dumps(prompt, sort_keys=True, default=str)


class _Guidance:
    """llguidance's HF logits processor: one matcher a row, each fed the row's last token before its next mask."""

    def __init__(self, tokenizer: Any, grammars: list[str], vocab_size: int) -> None:
        import llguidance  # noqa: PLC0415 - model plane only
        import llguidance.torch as ll_torch  # noqa: PLC0415 - model plane only

        self._torch = ll_torch
        self._matchers = [llguidance.LLMatcher(tokenizer, g) for g in grammars]
        self._mask = ll_torch.allocate_token_bitmask(len(grammars), vocab_size)
        self._started = False

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        for i, matcher in enumerate(self._matchers):
            if self._started and not matcher.is_stopped():
                matcher.consume_token(int(input_ids[i, -1]))
            if matcher.is_error():
                raise RuntimeError(f"guided generation (guidance): row {i}: {matcher.get_error()}")
            self._torch.fill_next_token_bitmask(matcher, self._mask, i)  # a stopped matcher allows only end-of-sequence
        self._started = True
        self._torch.apply_token_bitmask_inplace(scores, self._mask.to(scores.device))
        return scores


class Grammars:
    """Each named JSON schema compiled once, as a vLLM worker with ``backend`` and ``disable_any_whitespace=compact``
    compiles it; :meth:`processor` is the logits processor of one generation batch (one schema name a row)."""

    def __init__(self, tokenizer: Any, vocab_size: int, schemas: dict[str, str], backend: str, compact: bool) -> None:
        self.backend, self.vocab_size = backend, vocab_size
        if backend == "xgrammar":
            import xgrammar as xgr  # noqa: PLC0415 - model plane only

            compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
            self._compiled = {name: compiler.compile_json_schema(schema, any_whitespace=not compact,
                                                                 separators=(",", ":") if compact else None)
                              for name, schema in schemas.items()}
        elif backend == "guidance":
            import llguidance  # noqa: PLC0415 - model plane only
            import llguidance.hf  # noqa: PLC0415 - model plane only

            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
            flexible = {"whitespace_flexible": not compact}
            self._compiled = {name: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=flexible)
                              for name, schema in schemas.items()}
        else:
            raise ValueError(f"structured-outputs backend {backend!r}: xgrammar or guidance")

    def processor(self, names: list[str]) -> Any:
        if self.backend == "xgrammar":
            from xgrammar.contrib.hf import LogitsProcessor  # noqa: PLC0415 - model plane only

            return LogitsProcessor([self._compiled[n] for n in names])
        return _Guidance(self._tokenizer, [self._compiled[n] for n in names], self.vocab_size)


def compile_grammars(tokenizer: Any, vocab_size: int, schemas: dict[str, type[StructuredOutput]], backend: str,
                     text_scale: float = 1.0) -> Grammars:
    """Every schema's grammar, compact JSON (no free whitespace: a small model pads with it), its strings as long as
    the society's calls allow (``agents.text_scale``)."""
    return Grammars(tokenizer, vocab_size, {name: json.dumps(schema.json_schema(text_scale)) for name, schema in schemas.items()},
                    backend, compact=True)


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
