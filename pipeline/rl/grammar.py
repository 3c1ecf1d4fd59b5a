"""A JSON schema's grammar as a vLLM worker compiles it, for HF ``generate`` in the CPU trainers (model plane only).

The workers decode every structured answer under its schema with their structured-outputs backend
(``serving.worker_defaults.structured_backend``: xgrammar or llguidance) and ``disable_any_whitespace``
(``compact_json``). A trainer that samples under a schema (GRPO's completions, ``train_pi``'s served-prefix check)
compiles it here with the same library and the options vLLM gives it, so it samples the tokens the society serves:
the two libraries spell the same JSON in different tokens (docs/serving.md).
"""

from __future__ import annotations

import json
from typing import Any

from pipeline import timing
from pipeline.config import WorkerParams
from pipeline.schemas import StructuredOutput


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
    """Each named JSON schema compiled once, as ``worker`` compiles it (its structured-outputs backend and
    ``disable_any_whitespace=compact_json``); :meth:`processor` is the logits processor of one generation batch (one
    schema name a row)."""

    def __init__(self, tokenizer: Any, vocab_size: int, schemas: dict[str, str], worker: WorkerParams) -> None:
        backend, compact = worker.structured_backend, worker.compact_json
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


def compile_grammars(tokenizer: Any, vocab_size: int, schemas: dict[str, type[StructuredOutput]], worker: WorkerParams,
                     text_scale: float = 1.0) -> Grammars:
    """Every schema's grammar as ``worker`` compiles it (its backend and ``compact_json``: a completion in another
    JSON layout than the served one trains the adapter on token contexts the society never shows it), its strings as
    long as the society's calls allow (``agents.text_scale``)."""
    return Grammars(tokenizer, vocab_size, {name: json.dumps(schema.json_schema(text_scale))
                                                   for name, schema in schemas.items()}, worker)


def greedy(folder: str, messages: list[dict[str, str]], schema: str, worker: WorkerParams, max_new_tokens: int) -> str:
    """What the model at ``folder`` answers ``messages`` under ``schema``, greedy, decoded as ``worker`` decodes it (its
    backend, ``compact_json``): the worker's temperature-0 answer, token for token (tests/test_serving_integration.py)."""
    import torch  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    with timing.phase(timing.Phase.MODEL_LOAD, plane="model"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return decode(model, tokenizer, messages, Grammars(tokenizer, model.config.vocab_size, {"s": schema}, worker), "s",
                  max_new_tokens)


def decode(model: Any, tokenizer: Any, messages: list[dict[str, str]], grammars: Grammars, name: str,
           max_new_tokens: int) -> str:
    """``model``'s greedy answer to ``messages`` under ``grammars``' schema ``name``."""
    from transformers import LogitsProcessorList  # noqa: PLC0415 - model plane only

    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([grammars.processor([name])]))
    return str(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
