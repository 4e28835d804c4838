"""Structured output and "never silent", end to end: the real SmolLM2 engine behind its HTTP server,
the real openai SDK, and every answer checked with jsonschema.

Strings in the schemas (testkit/schemas.py) are bounded (maxLength, enums, maxItems) so a 135M model
always reaches the end of the object well within max_tokens; the grammar, not the model, is what makes
the output valid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from cachegw.backend.core.sampling_params import SamplingParams, StructuredOutput
from testkit.schemas import SCHEMAS, obj

MODEL = "SmolLM2-135M-Instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def schema_format(schema: dict, name: str = "answer", **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


@pytest.fixture(scope="module")
def client(shared_backend_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_backend_url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def http(shared_backend_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_backend_url.removesuffix("/v1"), timeout=600) as c:
        yield c


def ask(client: openai.OpenAI, question: str, response_format: dict, **kw) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], response_format=response_format,
        temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 160), **kw,
    )  # fmt: skip
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def test_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    """Unconstrained, the model wraps JSON in prose and code fences; with the schema every answer parses,
    validates, and ends with finish_reason stop (the grammar completed), sent together as one batch."""
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futures = {k: pool.submit(ask, client, q, schema_format(s)) for k, (q, s) in SCHEMAS.items()}
        answers = {k: f.result() for k, f in futures.items()}
    for key, (text, finish) in answers.items():
        assert finish == "stop", (key, text)
        jsonschema.validate(json.loads(text), SCHEMAS[key][1])


def test_sampled_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    """Sampling draws only among the tokens the grammar allows, so seeds change the answer, not its
    validity (the three seeds run as one batch)."""
    question, schema = SCHEMAS["bounds"]
    with ThreadPoolExecutor(3) as pool:
        runs = [
            pool.submit(ask, client, question, schema_format(schema), temperature=1.0, seed=s)
            for s in (1, 2, 3)
        ]
        answers = [f.result() for f in runs]
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    text, finish = ask(client, "Give me a JSON object with a key 'ok' set to true.", {"type": "json_object"})
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_text_format_is_plain_generation(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12)
    text, _ = ask(client, "Hello", {"type": "text"}, max_tokens=12)
    assert text == plain.choices[0].message.content


def test_streamed_structured_output_reassembles(client: openai.OpenAI) -> None:
    question, schema = SCHEMAS["nested"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], response_format=schema_format(schema),
        temperature=0, max_tokens=160, stream=True,
    )  # fmt: skip
    pieces, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    text = "".join(pieces)
    assert finishes[-1] == "stop" and len([p for p in pieces if p]) > 3
    jsonschema.validate(json.loads(text), schema)
    assert text == ask(client, question, schema_format(schema))[0]


def test_completions_endpoint_takes_response_format(http: httpx.Client) -> None:
    """vLLM's extension: /v1/completions honours response_format too."""
    _, schema = SCHEMAS["enum"]
    body = {"prompt": "Review: great film. Verdict as JSON:", "max_tokens": 60, "temperature": 0,
            "response_format": schema_format(schema)}  # fmt: skip
    resp = http.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    jsonschema.validate(json.loads(resp.json()["choices"][0]["text"]), schema)


def error_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(
    "response_format, param",
    [
        (schema_format({"type": "wizard"}), "response_format"),
        (schema_format({"type": "string", "format": "no-such-format"}, strict=True), "response_format"),
        (schema_format({"$ref": "#/definitions/missing"}), "response_format"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),  # noqa: E501
        ({"type": "xml"}, "response_format.type"),
        ({"type": "structural_tag"}, "response_format.type"),
        ("json", "response_format"),
    ],
)  # fmt: skip
def test_bad_response_format_is_a_400(http: httpx.Client, response_format, param: str) -> None:
    body = {"messages": HELLO, "max_tokens": 4, "response_format": response_format}
    assert error_of(http.post(CHAT, json=body))["param"] == param


def test_lenient_schema_when_not_strict(client: openai.OpenAI) -> None:
    """strict false (OpenAI's default): a keyword the compiler does not implement is skipped, not refused."""
    schema = obj({"email": {"type": "string", "format": "no-such-format", "maxLength": 20}})
    text, _ = ask(client, "Give an email address as JSON.", schema_format(schema, strict=False))
    assert set(json.loads(text)) == {"email"}


UNSUPPORTED = [
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "web_search_options", {}),
    (CHAT, "min_p", 0.1),  # another engine's extension: unknown here, so refused, not dropped
    (CHAT, "echo", True),  # a completions field
    (COMPLETIONS, "suffix", "end"),
    (COMPLETIONS, "tools", []),  # a chat field
]


@pytest.mark.parametrize("path, field, value", UNSUPPORTED)
def test_each_unsupported_field_is_a_400_naming_it(http: httpx.Client, path: str, field: str, value) -> None:
    """These were dropped silently: a 200 that ignored what the client asked for."""
    base = {"messages": HELLO} if path == CHAT else {"prompt": "Hello"}
    err = error_of(http.post(path, json={**base, "max_tokens": 2, field: value}))
    assert err["param"] == field and field in err["message"]


def test_no_op_fields_and_off_values_are_accepted(http: httpx.Client) -> None:
    """Fields that cannot change the output, and unimplemented ones sent with the value that means off
    (as SDKs and frameworks send them), are answered normally."""
    harmless = {
        "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
        "safety_identifier": "s", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
        "tool_choice": "none", "parallel_tool_calls": True, "tools": None, "modalities": ["text"],
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }  # fmt: skip
    resp = http.post(CHAT, json={"messages": HELLO, "max_tokens": 2, **harmless})
    assert resp.status_code == 200, resp.text
    resp = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "best_of": 1, "echo": False,
                                        "suffix": None, "user": "u1"})  # fmt: skip
    assert resp.status_code == 200, resp.text


def test_n_above_the_configured_limit_is_a_clear_400(http: httpx.Client) -> None:
    err = error_of(http.post(CHAT, json={"messages": HELLO, "n": 17}))
    assert err["param"] == "n" and "max_n" in err["message"]
    err = error_of(http.post(COMPLETIONS, json={"prompt": "Hi", "best_of": 17}))
    assert err["param"] == "best_of" and "max_n" in err["message"]


# --- the engine: batches mixing grammar rows and plain rows -----------------------------------


def test_plain_request_is_unchanged_beside_a_grammar(llm) -> None:
    """A grammar masks its own row only: a greedy plain request gives the very same tokens alone and
    in one batch with a structured one."""
    question, schema = SCHEMAS["array"]
    plain = llm.chat_prompt_ids([{"role": "user", "content": "Name three colours."}])
    structured = llm.chat_prompt_ids([{"role": "user", "content": question}])
    greedy = SamplingParams(max_tokens=40, temperature=0)
    alone = llm.generate([plain], greedy)[0].outputs[0].token_ids
    spec = StructuredOutput.json_schema(schema, True)
    constrained = SamplingParams(max_tokens=80, temperature=0, structured=spec)
    mixed = llm.generate([plain, structured, plain], [greedy, constrained, greedy])
    assert mixed[0].outputs[0].token_ids == alone and mixed[2].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), schema)


def test_preempted_sequences_keep_a_valid_grammar() -> None:
    """Room for two prompts' blocks (45 tokens, 3 blocks each) and no prefix cache: the first decode
    that needs a fourth block preempts the newest sequence mid-answer. It is recomputed from its
    output tokens, which its matcher has already consumed, and answers exactly as it does alone."""
    from cachegw.backend import LLM

    small = LLM(
        dtype="float32", quantization="none", kv_cache_tokens=96, max_num_seqs=4, enable_prefix_caching=False
    )
    question, schema = SCHEMAS["array"]
    spec = StructuredOutput.json_schema(schema, True)
    prompts = [
        small.chat_prompt_ids([{"role": "user", "content": f"{question} Answer {i}: {text}"}])
        for i, text in enumerate(["great", "awful", "fine", "superb"])
    ]
    params = SamplingParams(max_tokens=40, temperature=0, structured=spec)
    alone = [small.generate([p], params)[0].outputs[0] for p in prompts]
    assert small.engine.scheduler.num_preemptions == 0
    together = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert any(out.metrics.num_preemptions for out in together)
    for a, t in zip(alone, [o.outputs[0] for o in together], strict=True):
        assert t.token_ids == a.token_ids and t.finish_reason == "stop"
        jsonschema.validate(json.loads(t.text), schema)
