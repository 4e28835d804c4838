"""A chat request's messages and tools as the prompt the model reads.

A chat template that knows tools in a format the engine reads (Hermes' ``<tool_call>`` blocks:
Qwen2.5, Hermes 2/3) renders them itself: ``apply_chat_template(messages, tools=...)``, earlier calls
as ``tool_calls`` with their arguments as objects, results as ``role: tool`` messages. Any other
template (the embedded SmolLM2's knows no tools) gets the generic tool prompt: a system section
listing each function with the JSON schema of its arguments and the call format, earlier calls
written into the assistant's text in that format, and results as user turns in ``<tool_response>``
tags. ``tool_choice: none`` renders no tools at all.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from backend.tool_parser import HERMES, ToolFormat
from backend.tools import ToolRequest, tool_request
from protocol.errors import ApiError
from protocol.requests import ChatCompletionRequest, ChatMessage


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class _Call(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: str = "function"
    function: _Function


_CALLS = TypeAdapter(list[_Call])


def template_format(tokenizer: Any) -> ToolFormat | None:
    """The tool format the model's own chat template renders and expects, if it has one we read."""
    template = getattr(tokenizer, "chat_template", None)
    text = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    if "tools" in text and HERMES.open.strip() in text:
        return HERMES
    return None


def request_tools(req: ChatCompletionRequest, tokenizer: Any) -> ToolRequest | None:
    """The request's tool fields, in the format the model's template uses (else the generic prompt's)."""
    tools = tool_request(req.model_extra or {})
    if tools is None or not tools.calls_possible:
        return tools
    if req.response_format is not None and req.response_format.type != "text":
        raise ApiError(400, "response_format cannot be combined with tool calls: send tool_choice "
                       "'none' or leave response_format out.", param="response_format")  # fmt: skip
    templated = template_format(tokenizer)
    return tools if templated is None else replace(tools, format=templated, templated=True)


def generic_tool_section(req: ToolRequest) -> str:
    """The system prompt's tool section for a model whose template knows no tools."""
    fmt = req.format
    listed = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in req.functions)
    example = fmt.call_text("function_name", '{"argument": "value"}')
    if req.mode == "named":
        rule = f"You must call the function {req.named}."
    elif req.mode == "required":
        rule = "You must call at least one function."
    else:
        rule = "If no function helps with the request, answer in plain text instead, without any tag."
    return (
        "You can call functions. These are the available functions, each with the JSON schema of "
        f"its arguments:\n<tools>\n{listed}\n</tools>\n"
        f"To call a function, answer with the call alone, written exactly like this:\n{example}\n"
        f"{rule} A function's result comes back to you in <tool_response> tags."
    )


def _calls(message: ChatMessage, index: int) -> list[_Call]:
    try:
        return _CALLS.validate_python(message.tool_calls or [])
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = f"messages[{index}].tool_calls" + "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
        )
        raise ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param) from None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _templated(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = dict(m.template_dict())
        if m.role == "assistant" and m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in _calls(m, i)
            ]  # fmt: skip
        elif m.role == "tool" and m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _generic(messages: list[ChatMessage], req: ToolRequest | None, fmt: ToolFormat) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = dict(m.template_dict())
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in _calls(m, i):
                args = _arguments(c.function.arguments)
                text = c.function.arguments if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(fmt.call_text(c.function.name, text))
            item["content"] = "\n".join(p for p in (item["content"], fmt.separator.join(calls)) if p)
        elif m.role == "tool":
            item = {"role": "user", "content": f"<tool_response>\n{item['content']}\n</tool_response>"}
        out.append(item)
    if req is not None and req.calls_possible:
        section = generic_tool_section(req)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], req: ToolRequest | None) -> list[int]:
    """The prompt's token ids; ApiError(400) if the template rejects the conversation."""
    templated = template_format(tokenizer)
    kwargs: dict[str, Any] = {}
    if templated is not None:
        conversation = _templated(messages)
        if req is not None and req.calls_possible:
            kwargs["tools"] = [f.openai() for f in req.functions]
    else:
        conversation = _generic(messages, req, req.format if req else HERMES)
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
    except Exception as exc:  # template errors are the request's fault (roles, order...)
        raise ApiError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    return list(ids)
