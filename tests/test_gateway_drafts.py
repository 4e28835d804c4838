"""A refused near miss's stored answer goes to the backend as ``cachegw_draft``: to a backend that takes
drafts only, never to one that may not know the field; and the built-in engine's server takes the field.

The gateway is real and on loopback; its backends are the small recording server of testkit/servers.py
(the built-in engine cannot show which body it was sent). The last test asks the session's real engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import SYSTEM, client, gateway, settings_for

STORED = "Two plus two is four."


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Upstream, Upstream]]:
    drafting, plain = Upstream("m-drafts", answer=STORED), Upstream("m-plain", answer=STORED)
    with (
        serve_in_thread(recording_upstream(drafting)) as a,
        serve_in_thread(recording_upstream(plain)) as b,
    ):
        backends = [{"url": f"{a}/v1", "drafts": True}, f"{b}/v1"]
        with gateway(settings_for(tmp_path_factory.mktemp("drafts"), backends)) as url:  # type: ignore[arg-type]
            yield url, drafting, plain


def ask(url: str, model: str, question: str, **extra) -> dict[str, str]:
    raw = client(url).chat.completions.with_raw_response.create(
        model=model,
        messages=[SYSTEM, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=24,
        extra_body=extra or None,
    )
    return dict(raw.headers)


def sent(up: Upstream) -> dict:
    return json.loads(up.requests("/v1/chat/completions")[-1][3])


def test_a_refused_near_miss_sends_its_answer_as_the_draft(gw) -> None:
    url, drafting, _ = gw
    assert ask(url, "m-drafts", "What is 2 + 2?")["x-cache"] == "miss"
    assert "cachegw_draft" not in sent(drafting)  # nothing near yet
    h = ask(url, "m-drafts", "What is 2 + 3?")  # the same question but its number: refused
    assert h["x-cache"] == "miss" and h["x-cache-reason"] != "below-threshold"
    assert sent(drafting)["cachegw_draft"] == STORED
    ask(url, "m-drafts", "How do I bake sourdough bread at home?")
    assert "cachegw_draft" not in sent(drafting)  # nothing close: no draft


def test_a_backend_without_drafts_gets_none_not_even_the_clients(gw) -> None:
    url, _, plain = gw
    ask(url, "m-plain", "What is 3 + 3?")
    h = ask(url, "m-plain", "What is 3 + 4?", cachegw_draft="Seven.")
    assert h["x-cache"] == "miss"
    assert "cachegw_draft" not in sent(plain)


def test_the_draft_changes_no_cache_key(gw) -> None:
    url, _, _ = gw
    ask(url, "m-drafts", "What is 5 + 5?")
    assert ask(url, "m-drafts", "What is 5 + 5?", cachegw_draft="Ten.")["x-cache"] == "exact-hit"


def test_the_engines_server_takes_the_draft_field(shared_backend_url: str) -> None:
    r = httpx.post(
        f"{shared_backend_url}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 2,
            "temperature": 0,
            "cachegw_draft": "Hi there!",
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    bad = httpx.post(
        f"{shared_backend_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "cachegw_draft": 3},
        timeout=120,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cachegw_draft"
