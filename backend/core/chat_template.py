"""A model's chat template rendered with jinja2 as transformers renders it, without transformers.

The serving process keeps transformers out of its memory (about 135 MiB: its config classes import
the model-loading stack), so the template runs here: the same sandboxed environment (immutable,
``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``{% generation %}`` tag accepted), the same
globals (``raise_exception``, ``strftime_now``, a limited ``dict`` and ``namespace``), the same
``tojson`` (no HTML escaping, non-ASCII kept), and the same inputs: messages with None-valued keys
dropped and reasoning copied under the names templates read, the tools, the tokenizer's named
special tokens. ``tests/test_lean_tokenizer.py`` renders conversations both ways and compares.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning travels under; templates read the first (gpt-oss's: "thinking").
_REASONING = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask templates): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` for templates, without the type itself (no attribute tricks on the class)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (no way into Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


@lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    """The template compiled once per text (a server renders every request with the same one)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """JSON types only reach the template (pydantic models dumped, other objects named)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict:
    """One message as the template sees it: None-valued keys dropped, reasoning under each name."""
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, dict):
        raise TypeError(f"chat messages should be dicts, got {message!r}")
    out = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((out[k] for k in _REASONING if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def pick(template: str | dict[str, str] | None, tools: list | None) -> str:
    """The template to render: a model with several uses its ``tool_use`` one when tools are given."""
    if isinstance(template, dict):
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError(f"this model has several chat templates and no default: {sorted(template)}")
    if template is None:
        raise ValueError("this model's tokenizer has no chat template")
    return template


def render(
    template: str,
    conversation: list,
    special_tokens: dict[str, str],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as the model's prompt text (ValueError on an empty one)."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    messages = [_message(m) for m in conversation]
    return compiled(template).render(
        messages=messages,
        tools=_plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain({**special_tokens, **kwargs}),
    )
