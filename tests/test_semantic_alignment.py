"""A semantic hit accounts for every difference between two requests, end to end: the real gateway in
front of the real engine (the session's shared backend), the openai SDK, the request log in SQLite.

The document is ~900 words, far past the 256 word pieces the query encoder reads, so every request over
it embeds identically (cosine 1.0). Before the alignment (policies/pair_diff.py), another instruction or a
changed document over it was served the stored answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_cache_reasons import logged_reason
from tests.test_gateway import ask, backend_url, chat, gateway, settings_for  # noqa: F401

REPORT = (
    "Quarterly sales in the northern region were flat compared with last year, while the southern region "
    "grew strongly thanks to two new distribution partners. Returns increased for the premium headphone "
    "line after a firmware update caused connection drops; a fix was released in the last week of the "
    "quarter. Marketing spend was cut in the west, and sales there fell slightly. Inventory levels are "
    "healthy except for the budget speakers, which are close to selling out."
)
DOCUMENT = "\n\n".join(f"Region report {i}. {REPORT}" for i in range(12))


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:  # noqa: F811
    data_dir = tmp_path_factory.mktemp("alignment")
    with gateway(settings_for(data_dir, [backend_url])) as url:
        yield url, data_dir


def ask_about(document: str, instruction: str) -> list[dict]:
    return ask(f"{document}\n\n{instruction}")


def test_a_long_document_with_another_instruction_is_a_miss_and_a_reworded_one_a_hit(
    gw: tuple[str, Path],
) -> None:
    url, data_dir = gw
    first, h1, _ = chat(url, ask_about(DOCUMENT, "What is the tone of this text?"), max_tokens=8)
    assert h1["x-cache"] == "miss"
    same, h2, _ = chat(url, ask_about(DOCUMENT, "What's the tone of this text?"), max_tokens=8)
    assert (h2["x-cache"], h2["x-cache-reason"]) == ("semantic-hit", "semantic") and same == first
    _, h3, _ = chat(url, ask_about(DOCUMENT, "Translate this into French."), max_tokens=8)
    assert (h3["x-cache"], h3["x-cache-reason"]) == ("miss", "verifier")  # was a semantic hit
    assert float(h3["x-cache-similarity"]) > 0.99  # the encoder cannot tell them apart
    assert logged_reason(data_dir, h3["x-request-id"]) == "verifier"


def test_a_changed_document_is_a_miss_whatever_the_instruction(gw: tuple[str, Path]) -> None:
    url, data_dir = gw
    chat(url, ask_about(DOCUMENT, "Summarize the report."), max_tokens=8)
    edited = DOCUMENT.replace("Region report 11. Quarterly sales", "Region report 11. Yearly sales")
    _, h, _ = chat(url, ask_about(edited, "Summarize the report."), max_tokens=8)
    assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "context-differs")
    assert logged_reason(data_dir, h["x-request-id"]) == "context-differs"


def test_code_and_opposite_actions_name_their_guard(gw: tuple[str, Path]) -> None:
    url, _ = gw
    code = "```python\ndef is_adult(age):\n    return age >= 18\n```"
    chat(url, ask(f"Why does this code not work?\n\n{code}"), max_tokens=8)
    _, h, _ = chat(url, ask(f"Why does this code not work?\n\n{code.replace('>=', '>')}"), max_tokens=8)
    assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "guard:code")
    chat(url, ask("Turn on the kitchen lights."), max_tokens=8)
    _, h, _ = chat(url, ask("Turn off the kitchen lights."), max_tokens=8)
    assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "guard:polarity")
