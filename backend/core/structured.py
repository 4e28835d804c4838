"""Structured output: ``response_format`` enforced token by token with llguidance.

A request's JSON schema (or "any JSON object") is compiled once into a matcher that knows, after
each token, which tokens may come next. The sampler masks every other token of that row to -inf
before it picks, the engine feeds the picked token back, and the sequence finishes (``stop``)
as soon as the grammar is complete. EOS is allowed only where the JSON could end. Rows without a
grammar are never touched, so requests without one pay nothing.

Compiled matchers are kept in a small LRU keyed by the schema's text; a request gets a cheap copy
of the compiled one. The matcher's state is a function of the output tokens alone, and a preempted
sequence keeps its output tokens, so recomputing it after preemption leaves the matcher valid.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import torch

from cachegw.backend.core.sampling_params import ANY_OBJECT, InvalidParameter, StructuredOutput
from cachegw.configtools.lru import Lru

log = logging.getLogger("cachegw.backend")

PARAM = "response_format"
# Compact separators with one space, as models write JSON; no free whitespace elsewhere, or a small
# model can spend its whole budget on newlines without ever closing the object.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """One sequence's matcher: which tokens may come next, and whether the output is complete."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (the mask should prevent it)."""
        ok = bool(self._matcher.consume_token(token))
        if not ok:
            log.warning("grammar refused token %d: %s", token, self._matcher.get_error())
        return ok

    def copy(self) -> Grammar:
        """An independent matcher in the same state (for a forked sample)."""
        return Grammar(self._matcher.deep_copy())

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow: the JSON is complete."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Compiles response formats against the engine's tokenizer; one per engine, used by its thread.

    The llguidance tokenizer (about a second to build) is made on the first structured request.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: set[int], cache_size: int = 64) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None
        self._compiled: Lru[tuple[bool, str, bool], Any] = Lru(cache_size)  # least recently used out first

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance

            if self.hf_tokenizer is None:
                raise InvalidParameter(PARAM, "this model has no tokenizer: structured output needs one")
            # the Rust tokenizer's JSON, as llguidance.hf reads it (without importing transformers)
            rust = copy.copy(self.hf_tokenizer.backend_tokenizer)
            rust.no_padding()
            rust.no_truncation()
            eos = self.eos_ids or self.hf_tokenizer.eos_token_id
            tokenizer = llguidance.LLTokenizer(rust.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            # The first mask ever computed builds llguidance's token tables (~1.4 s here): pay it now,
            # with the tokenizer, not inside some request's first step.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
            llguidance.LLMatcher(tokenizer, grammar, log_level=0).compute_bitmask()
            self._tokenizer = tokenizer
        return self._tokenizer

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled matcher for ``spec`` (cached); InvalidParameter naming response_format if bad."""
        import llguidance

        if spec.embedded is not None:  # a bad response_format inside the tools' grammar is named as such
            self.compile(spec.embedded)
        key = (spec.kind == "lark", spec.schema, spec.strict)
        hit = self._compiled.get(key)  # made recently used
        if hit is not None:
            return hit
        options: Any = {**JSON_OPTIONS, "lenient": not spec.strict}
        what = "Invalid tool definitions" if spec.kind == "lark" else "Invalid JSON schema in response_format"
        try:
            if spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.schema)
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=options)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except (ValueError, TypeError) as exc:
            raise InvalidParameter(spec.param, f"{what}: {exc}") from None
        if matcher.is_error():
            raise InvalidParameter(spec.param, f"{what}: {matcher.get_error()}")
        self._compiled[key] = matcher
        return matcher

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for one sequence."""
        return Grammar(self.compile(spec).deep_copy())


def apply_grammar_masks(logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
    """Set the tokens each row's grammar forbids to -inf, in place, in ``logits`` [R, V].

    Rows without a grammar are not touched, and with no grammar at all nothing runs.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].fill_mask(bitmask, j)  # type: ignore[union-attr]
    forbidden = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        # numpy, in place, row by row: one thread, and no copy of the batch (torch's indexed
        # masked_fill took 10-40x longer on a busy 2-core machine).
        array = logits.numpy()
        for j, i in enumerate(rows):
            np.copyto(array[i], -np.inf, where=forbidden[j])
        return
    with torch.inference_mode():  # the model's logits are inference tensors
        index = torch.tensor(rows, device=logits.device)
        mask = torch.from_numpy(forbidden).to(logits.device)
        logits[index] = logits[index].masked_fill(mask, float("-inf"))
