"""Every API through `cachegw serve` as users start it: the gateway with its supervised built-in engine
(so `cache_pins`, drafts and embeddings reach the engine as in `make serve`), each with the SDK people
install: chat and Responses (openai), Messages (anthropic), embeddings (openai); streams included, and
the same question asked through another API is a hit."""

from __future__ import annotations

import anthropic
import openai

from testkit.servers import free_port
from tests.test_gateway_process import start_serve, stop, wait_health

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def test_every_api_through_cachegw_serve(tmp_path):
    backend_port, port = free_port(), free_port()
    config = tmp_path / "cachegw.toml"
    config.write_text(
        f'[backend_server]\nport = {backend_port}\n[engine]\nkv_cache_tokens = 8192\ncompile = "off"\n'
    )
    proc = start_serve(config, tmp_path / "data", port)
    try:
        wait_health(port, proc, timeout=600)
        base = f"http://127.0.0.1:{port}"
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="tenant-a", max_retries=0, timeout=300)
        an = anthropic.Anthropic(base_url=base, api_key="tenant-a", max_retries=0, timeout=300)

        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}],
            temperature=0,
            max_tokens=24,
        )
        assert raw.headers["x-cache"] == "miss"
        text = raw.parse().choices[0].message.content
        hit = oa.responses.with_raw_response.create(
            model=MODEL, instructions=SYSTEM, input="Name a fruit.", temperature=0, max_output_tokens=24
        )
        assert hit.headers["x-cache"] == "exact-hit" and hit.parse().output_text == text

        with oa.responses.stream(
            model=MODEL, instructions=SYSTEM, input="Name a tree.", temperature=0, max_output_tokens=24
        ) as s:
            events = list(s)
        # 24 tokens may end the answer (completed) or cut it (incomplete: max_output_tokens); both close
        # the stream with the whole response
        last = events[-1]
        assert events[0].type == "response.created"
        assert last.type in ("response.completed", "response.incomplete") and last.response.output_text
        if last.type == "response.incomplete":
            assert last.response.incomplete_details.reason == "max_output_tokens"

        reply = an.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=24,
            system=[{"type": "text", "text": SYSTEM * 8, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Name a river."}],
            extra_body={"temperature": 0},
        )
        message = reply.parse()
        assert reply.headers["x-cache"] == "miss" and message.content[0].type == "text"
        assert message.usage.cache_creation_input_tokens > 0  # the engine pinned the system prompt
        with an.messages.stream(
            model=MODEL,
            max_tokens=24,
            messages=[{"role": "user", "content": "Name a mountain."}],
            extra_body={"temperature": 0},
        ) as s:
            streamed = "".join(s.text_stream)
            assert s.get_final_message().stop_reason in ("end_turn", "max_tokens") and streamed

        first = oa.embeddings.with_raw_response.create(model=MODEL, input=["a cat", "a dog"])
        again = oa.embeddings.with_raw_response.create(model=MODEL, input=["a dog", "a cat"])
        assert first.headers["x-cache"] == "miss" and again.headers["x-cache"] == "exact-hit"
        vectors = {e.index: e.embedding for e in first.parse().data}
        assert again.parse().data[1].embedding == vectors[0] and len(vectors[0]) > 100
    finally:
        stop(proc)
