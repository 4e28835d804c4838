"""Canonicalization: each rule alone, the guarantees as properties (idempotent, meaning kept, input
untouched), volatile values, restored replies, code fences, config errors. Pure Python, a few seconds."""

from __future__ import annotations

import copy
import re
import time
import tomllib
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachegw.policies.canonical_text import canonical_json, normalize_for_match, normalize_reply
from cachegw.policies.canonicalize import RULES, canonicalize
from cachegw.policies.canonicalize_config import CanonicalizeConfig

ROOT = Path(__file__).resolve().parents[1]
ALL_ON = CanonicalizeConfig()


def replace(config: CanonicalizeConfig, **changes: object) -> CanonicalizeConfig:
    return config.model_copy(update=changes)


ALL_OFF = replace(ALL_ON, **{r: False for r in RULES})
FAST = settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def only(rule: str) -> CanonicalizeConfig:
    return replace(ALL_OFF, **{rule: True})


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def system(text: Any) -> dict[str, Any]:
    return {"role": "system", "content": text}


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {}}}


SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "string", "description": "B"}, "a": {"type": "integer"}},
}
STORE = {"Hello world": "Hello world\n"}
# rule -> (body, a check that holds when the rule was applied and fails when it was not)
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "unicode_nfc": ({"messages": [user("Cafe\u0301")]}, lambda b: b["messages"][0]["content"] == "Café"),
    "line_endings": ({"messages": [user("a\r\nb\rc")]}, lambda b: b["messages"][0]["content"] == "a\nb\nc"),
    "trailing_whitespace": (
        {"messages": [user("a  \nb\t")]},
        lambda b: b["messages"][0]["content"] == "a\nb",
    ),
    "blank_lines": (
        {"messages": [user("\n\na\n\n\n\nb\n\n")]},
        lambda b: b["messages"][0]["content"] == "a\n\nb",
    ),
    "json_key_order": (
        {"messages": [user("q")], "tools": [tool("f", SCHEMA)]},
        lambda b: list(b["tools"][0]["function"]["parameters"]) == ["properties", "type"],
    ),
    "sort_tools": (
        {"messages": [user("q")], "tools": [tool("b"), tool("a")]},
        lambda b: [t["function"]["name"] for t in b["tools"]] == ["a", "b"],
    ),
    "merge_system": (
        {"messages": [system("One."), system([{"type": "text", "text": "Two."}]), user("q")]},
        lambda b: b["messages"][:2] == [system("One.\n\nTwo."), user("q")],
    ),
    "volatile_to_tail": (
        {"messages": [system("Now: 2026-11-22T10:00:00Z."), user("q")]},
        lambda b: (
            b["messages"]
            == [
                system("Now: [volatile:1]."),
                user("q\n\nContext values: [volatile:1] = 2026-11-22T10:00:00Z"),
            ]
        ),
    ),
    "restore_assistant": (
        {"messages": [user("hi"), {"role": "assistant", "content": "Hello   world"}, user("q")]},
        lambda b: b["messages"][1]["content"] == "Hello world\n",
    ),
}


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_alone_fires_and_is_recorded(rule: str) -> None:
    body, applied = CASES[rule]
    out, rules = canonicalize(body, only(rule), STORE.get)
    assert rules == [rule] and applied(out)


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_switched_off_is_not_applied(rule: str) -> None:
    body, applied = CASES[rule]
    out, rules = canonicalize(body, replace(ALL_ON, **{rule: False}), STORE.get)
    assert rule not in rules and not applied(out)


def test_rules_are_reported_in_fixed_order_and_disabled_returns_an_equal_copy() -> None:
    body = {"messages": [system("a  \r\n\n\n\nb"), user("Cafe\u0301")]}
    assert canonicalize(body, ALL_ON)[1] == [
        "unicode_nfc",
        "line_endings",
        "trailing_whitespace",
        "blank_lines",
    ]
    out, rules = canonicalize(body, replace(ALL_ON, enabled=False))
    assert out == body and out is not body and out["messages"] is not body["messages"] and rules == []


def test_defaults_equal_config_toml_and_config_errors() -> None:
    with open(ROOT / "config.toml", "rb") as f:
        section = tomllib.load(f)["canonicalize"]
    assert CanonicalizeConfig.from_dict(section) == CanonicalizeConfig()
    assert set(CanonicalizeConfig.model_fields) == set(section)
    with pytest.raises(ValueError, match="unknown keys"):
        CanonicalizeConfig.from_dict({**section, "sort_tool": True})
    with pytest.raises(ValueError, match="sort_tools"):
        CanonicalizeConfig.from_dict({**section, "sort_tools": "yes"})
    with pytest.raises(ValueError, match=re.escape("'[0-9'")):
        CanonicalizeConfig(volatile_patterns=(r"\d+", "[0-9"))
    with pytest.raises(ValueError, match="backreference"):
        CanonicalizeConfig(volatile_patterns=(r"(a)\1",))
    with pytest.raises(ValueError, match="unique"):
        CanonicalizeConfig(volatile_patterns=(r"(?P<x>a)", r"(?P<x>b)"))


def test_code_fences_keep_their_whitespace() -> None:
    code = "```python  \ndef f():   \n    return 1\t\n\n\n\n    pass\n```"
    text = f"Intro  \r\n\n\n\n{code}\n\n\n\nAfter  \n  ~~~\n  keep  \n\n\n\n"
    out, _ = canonicalize({"messages": [user(text)]}, ALL_ON)
    assert (
        out["messages"][0]["content"] == f"Intro\n\n{code}\n\nAfter\n  ~~~\n  keep  \n\n\n\n"
    )  # unclosed: to the end
    inline = "a ```x``` b  \n\n\n\n```\ncode  \n```"  # an info string with a backtick is no fence
    assert canonicalize({"messages": [user(inline)]}, ALL_ON)[0]["messages"][0]["content"] == (
        "a ```x``` b\n\n```\ncode  \n```"
    )


def test_tool_content_arguments_and_prompts_get_only_nfc_and_line_endings() -> None:
    data = "  x  \r\n\n\n\nCafe\u0301  "
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": data}}
    body = {
        "messages": [
            user("q"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": data},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": data, "parameters": {}}}],
    }
    want = "  x  \n\n\n\nCafé  "
    out, _ = canonicalize(body, ALL_ON)
    assert out["messages"][1]["tool_calls"][0]["function"]["arguments"] == want
    assert out["messages"][2]["content"] == want and out["tools"][0]["function"]["description"] == want
    assert canonicalize({"prompt": ["Q: 2026-11-22\r\nA: "]}, ALL_ON)[0]["prompt"] == ["Q: 2026-11-22\nA: "]


def test_schemas_sort_keys_but_keep_property_order_and_data() -> None:
    schema = {
        "type": "object",
        "required": ["reasoning", "answer"],
        "properties": {
            "reasoning": {"type": "string", "title": "R"},
            "answer": {"enum": [{"z": 1, "a": 2}], "type": "string"},
        },
        "additionalProperties": False,
        "default": {"z": 1, "a": 2},
    }
    body = {
        "messages": [user("q")],
        "response_format": {"json_schema": {"schema": schema, "name": "n"}, "type": "json_schema"},
    }
    rf = canonicalize(body, ALL_ON)[0]["response_format"]
    assert list(rf) == ["json_schema", "type"] and list(rf["json_schema"]) == ["name", "schema"]
    out = rf["json_schema"]["schema"]
    assert list(out) == ["additionalProperties", "default", "properties", "required", "type"]
    assert list(out["properties"]) == ["reasoning", "answer"] and out["required"] == ["reasoning", "answer"]
    assert list(out["properties"]["answer"]) == ["enum", "type"]
    assert list(out["default"]) == ["z", "a"] and list(out["properties"]["answer"]["enum"][0]) == ["z", "a"]


def test_sort_tools_is_stable() -> None:
    tools = [tool("b"), {**tool("a"), "tag": 1}, tool("c"), {**tool("a"), "tag": 2}]
    out = canonicalize({"messages": [user("q")], "tools": tools}, ALL_ON)[0]["tools"]
    assert [(t["function"]["name"], t.get("tag")) for t in out] == [
        ("a", 1),
        ("a", 2),
        ("b", None),
        ("c", None),
    ]


def chat_for(system_text: str, question: str = "Hi") -> dict[str, Any]:
    return {
        "messages": [
            system(system_text),
            user("Earlier?"),
            {"role": "assistant", "content": "Yes."},
            user(question),
        ]
    }


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("2026-11-22T10:00:00Z", "2026-11-23T08:31:07.125+01:00"),
        ("2026-11-22", "2027-01-05"),
        ("3f2a9c1e-7b4d-4e2a-9f1c-2b3d4e5f6a7b", "00000000-0000-4000-8000-000000000000"),
        ("Mon, Nov 22 2026", "Tuesday, December 1, 2026"),
        ("request_id=abc-123", "request_id=zz-9"),
        ("10:00 AM", "23:59:59 UTC"),
        ("1732270000", "1732270000123"),
    ],
)
def test_volatile_values_make_system_prompts_identical(a: str, b: str) -> None:
    template = "You are helpful.\nNow: {} (as given).\nBe brief." + " Stable policy text." * 20
    out_a, rules = canonicalize(chat_for(template.format(a)), ALL_ON)
    out_b, _ = canonicalize(chat_for(template.format(b)), ALL_ON)
    assert rules == ["volatile_to_tail"]
    assert out_a["messages"][:-1] == out_b["messages"][:-1]  # everything before the last user message
    assert out_a["messages"][0]["content"] == template.format("[volatile:1]")
    assert out_a["messages"][-1]["content"] == f"Hi\n\nContext values: [volatile:1] = {a}"


def test_volatile_placement_numbering_and_shapes() -> None:
    msgs = [
        system(
            "Date 2026-11-22, again 2026-11-22, id 3f2a9c1e-7b4d-4e2a-9f1c-2b3d4e5f6a7b, old [volatile:4]."
        ),
        {"role": "developer", "content": [{"type": "text", "text": "At 10:30 PM."}]},
        user([{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "x"}}]),
    ]
    out, _ = canonicalize({"messages": msgs}, ALL_ON)
    assert (
        out["messages"][0]["content"]
        == "Date [volatile:5], again [volatile:5], id [volatile:6], old [volatile:4]."
    )
    assert out["messages"][1]["content"] == [{"type": "text", "text": "At [volatile:7]."}]
    assert out["messages"][2]["content"][-1] == {
        "type": "text",
        "text": "Context values: [volatile:5] = 2026-11-22; "
        "[volatile:6] = 3f2a9c1e-7b4d-4e2a-9f1c-2b3d4e5f6a7b; [volatile:7] = 10:30 PM",
    }
    no_user = {"messages": [system("Now 2026-11-22."), {"role": "assistant", "content": "ok"}]}
    assert canonicalize(no_user, ALL_ON)[0] == no_user  # nowhere to put the values: left as it was


def test_restore_assistant_uses_stored_bytes_only_when_they_match() -> None:
    reply = "Sure:\n\n```py\nfor x in xs:  \n    print(x)\n```\n\n\n\nDone.  "
    # what chat UIs send back: stripped, CRLF, blank lines collapsed, prose spaces changed
    resent = " Sure:\r\n```py\r\nfor x in xs:\r\n    print(x)\r\n```\r\nDone."
    body = {"messages": [user("q"), {"role": "assistant", "content": resent}, user("r")]}
    out, rules = canonicalize(body, ALL_ON, {normalize_reply(reply): reply}.get)
    assert out["messages"][1]["content"] == reply and "restore_assistant" in rules  # exact, not re-normalised
    out, rules = canonicalize(body, ALL_ON, lambda key: "something else entirely")
    assert "restore_assistant" not in rules and out["messages"][1]["content"] == resent.replace("\r\n", "\n")
    parts = {"messages": [{"role": "assistant", "content": [{"type": "text", "text": resent}]}]}
    restored = canonicalize(parts, ALL_ON, {normalize_reply(reply): reply}.get)[0]
    assert restored["messages"][0]["content"][0]["text"] == reply


@pytest.mark.parametrize(
    "changed",
    [
        "Sure:\n\n```py\nfor x in xs:\nprint(x)\n```\n\nDone.",  # indentation inside code is meaning
        "Sure: ```py for x in xs: print(x) ``` Done.",  # code flattened onto one line
        "Sure:\n\n```py\nfor x in xs:\n    print(y)\n```\n\nDone.",
    ],
)
def test_restore_assistant_never_replaces_code_that_differs(changed: str) -> None:
    """The stored reply must not overwrite what the client sent when the code in it differs: the
    model would then answer about other code than the user's (Python's indentation changes which
    lines a loop runs)."""
    reply = "Sure:\n\n```py\nfor x in xs:\n    print(x)\n```\n\nDone."
    body = {"messages": [user("q"), {"role": "assistant", "content": changed}, user("r")]}
    out, rules = canonicalize(body, ALL_ON, {normalize_reply(reply): reply}.get)
    assert "restore_assistant" not in rules and out["messages"][1]["content"] != reply


def test_helpers_for_the_gateway() -> None:
    assert normalize_for_match("  Cafe\u0301 \r\n\t x  ") == "Café x"
    assert canonical_json({"b": 1.0, "a": ["é", 0.5, True]}) == '{"a":["é",0.5,true],"b":1}'


def test_typical_request_is_fast() -> None:
    body = chat_for("Today is 2026-11-22.\n" + "You are a careful support agent. Policy text.  \n" * 30)
    body["tools"] = [tool(n, SCHEMA) for n in ("search", "lookup", "create")]
    canonicalize(body, ALL_ON)
    start = time.perf_counter()
    for _ in range(200):
        canonicalize(body, ALL_ON)
    assert (time.perf_counter() - start) / 200 < 2e-3  # ~0.1 ms measured; loose for a busy CI machine


# ---- properties -------------------------------------------------------------------------------

VOLATILE = ["2026-11-22T10:00:00Z", "2026-01-05", "3f2a9c1e-7b4d-4e2a-9f1c-2b3d4e5f6a7b", "Mon, Nov 22 2026",
            "request_id=abc-12", "10:30 PM", "1732270000"]  # fmt: skip
CHUNKS = st.sampled_from(
    ["alpha", "Beta", "x=1;", "naïve", "Cafe\u0301", "\u0301", "über", "(7)", "-", "*", "`", "[v]"]
    + [" ", "  ", "\t", "\n", "\n\n\n", "\r\n", "\r", " \n", "\n  \n"]
    + ["```", "```py", "~~~", "    ```", "```a```"]
    + [f" {v} " for v in VOLATILE]
)
TEXT = st.lists(CHUNKS, max_size=14).map("".join)
CONTENT = TEXT | st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2)
MESSAGE = st.builds(
    lambda r, c: {"role": r, "content": c},
    st.sampled_from(["user", "assistant", "developer", "tool"]),
    CONTENT,
)
NAMES = st.sampled_from(["a", "b", "c", "search"])
TOOL = st.builds(
    lambda n, d: {"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMA}},
    NAMES,
    TEXT,
)
BODY = st.builds(
    lambda s, m, t: {"model": "m", "messages": [system(x) for x in s] + m, **({"tools": t} if t else {})},
    st.lists(CONTENT, max_size=3),
    st.lists(MESSAGE, min_size=1, max_size=4),
    st.lists(TOOL, max_size=3),
)
CONFIG = st.builds(
    lambda flags: replace(ALL_ON, **dict(zip(RULES, flags, strict=True))),
    st.tuples(*[st.booleans()] * len(RULES)),
)


def restore(key: str) -> str:
    return key + "  "  # a stored reply whose bytes differ from the client's copy


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")


def visible(text: str) -> str:
    return "".join(unicodedata.normalize("NFC", text).split())


def containers(obj: Any) -> list[int]:
    if isinstance(obj, dict):
        return [id(obj), *(i for v in obj.values() for i in containers(v))]
    return [id(obj), *(i for v in obj for i in containers(v))] if isinstance(obj, list) else []


@FAST
@given(BODY, CONFIG)
def test_property_idempotent_and_input_untouched(body: dict[str, Any], cfg: CanonicalizeConfig) -> None:
    before = copy.deepcopy(body)
    once, _ = canonicalize(body, cfg, restore)
    assert body == before
    assert not set(containers(once)) & set(containers(body))
    twice, rules = canonicalize(once, cfg, restore)
    assert twice == once and rules == []


@FAST
@given(BODY, CONFIG)
def test_property_every_visible_character_survives(body: dict[str, Any], cfg: CanonicalizeConfig) -> None:
    out, rules = canonicalize(body, cfg, restore)
    messages = copy.deepcopy(out["messages"])
    values: dict[str, str] = {}
    if "volatile_to_tail" in rules:  # take the note off the last user message, put the values back
        last = next(m for m in reversed(messages) if m["role"] == "user")
        holder, slot = (
            (last, "content") if isinstance(last["content"], str) else (last["content"][-1], "text")
        )
        holder[slot], _, note = holder[slot].rpartition("Context values: ")
        values = dict(re.findall(r"(\[volatile:\d+\]) = (.*?)(?=; \[volatile:|$)", note))
        assert values and all(v in VOLATILE for v in values.values())
    put_back = lambda t: re.sub(r"\[volatile:\d+\]", lambda m: values.get(m.group(0), m.group(0)), t)
    got = "\n".join(put_back(text_of(m["content"])) for m in messages)
    assert visible(got) == visible("\n".join(text_of(m["content"]) for m in body["messages"]))
    want_tools = sorted(
        (t["function"]["name"], visible(t["function"]["description"])) for t in body.get("tools", [])
    )
    assert (
        sorted((t["function"]["name"], visible(t["function"]["description"])) for t in out.get("tools", []))
        == want_tools
    )


@FAST
@given(
    st.lists(st.sampled_from(["Be kind.", "Use tools.", "  ", "\n\n\n", "Policy 4.2"]), max_size=8).map(
        "".join
    ),
    st.sampled_from(VOLATILE),
    st.sampled_from(VOLATILE),
)
def test_property_prompts_differing_in_a_volatile_value_share_their_prefix(
    stable: str, a: str, b: str
) -> None:
    one = canonicalize(chat_for(f"{stable} Now: {a} .{stable}"), ALL_ON)[0]["messages"]
    two = canonicalize(chat_for(f"{stable} Now: {b} .{stable}"), ALL_ON)[0]["messages"]
    assert one[:-1] == two[:-1] and one[-1]["content"].endswith(f"= {a}")
