"""The incremental detokenizer with the embedded model's real tokenizer: text equals a full decode, stop
strings cut the text (also across tokens), and a running stream holds back what may become a stop."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from cachegw.backend.config import load_engine_config
from cachegw.backend.core.detokenizer import IncrementalDetokenizer
from cachegw.backend.executor.model_loader import resolve_model_dir

TEXTS = ["Hello world, how are you?", "naïve café — 東京 🙂 done", "  leading spaces\nand lines"]


@pytest.fixture(scope="module")
def tokenizer():
    cfg = load_engine_config()
    folder = resolve_model_dir(cfg.model, cfg.resolved_cache_dir, weights=False)  # the tokenizer alone
    return AutoTokenizer.from_pretrained(str(folder))


def feed(tok, text: str, stop: list[str]) -> tuple[IncrementalDetokenizer, str | None, int]:
    det = IncrementalDetokenizer(tok, stop)
    ids = tok.encode(text, add_special_tokens=False)
    for n, t in enumerate(ids, 1):
        hit = det.add(t)
        if hit is not None:
            return det, hit, n
    det.flush()
    return det, None, len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_full_decode(tokenizer, text: str) -> None:
    det, hit, _ = feed(tokenizer, text, [])
    assert hit is None
    assert det.text == tokenizer.decode(
        tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True
    )


def test_stop_string_cuts_the_text_before_it_even_across_tokens(tokenizer) -> None:
    text = "The answer is forty-two. Then more text follows here."
    det, hit, n = feed(tokenizer, text, ["two. Then", "never"])
    assert hit == "two. Then"
    assert det.text == "The answer is forty-"
    assert n < len(tokenizer.encode(text, add_special_tokens=False))


def test_earliest_stop_wins(tokenizer) -> None:
    det, hit, _ = feed(tokenizer, "alpha beta gamma", ["gamma", "beta"])
    assert hit == "beta" and det.text == "alpha "


def test_running_text_holds_back_a_possible_stop_prefix(tokenizer) -> None:
    det = IncrementalDetokenizer(tokenizer, ["STOP!"])
    for t in tokenizer.encode("one two three", add_special_tokens=False):
        assert det.add(t) is None
    assert det.visible_text(finished=True) == det.text
    assert det.visible_text(finished=False) == det.text[: len(det.text) - len("STOP!") + 1]
    assert IncrementalDetokenizer(tokenizer, []).visible_text(finished=False) == ""


def test_no_tokenizer_means_no_text() -> None:
    det = IncrementalDetokenizer(None, ["x"])
    assert det.add(5) is None
    det.flush()
    assert det.text == ""
