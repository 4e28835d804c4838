"""A chat request's messages and tools as the prompt the model reads.

A chat template that knows tools in a format the engine reads (Hermes' ``<tool_call>`` blocks:
Qwen2.5, Hermes 2/3; Llama 3.1+'s JSON calls; Mistral's ``[TOOL_CALLS]``) renders them itself:
``apply_chat_template(messages, tools=...)``, earlier calls as ``tool_calls`` with their arguments as
objects, results as ``role: tool`` messages (Mistral's template insists on 9-character call ids: other
ids are mapped to one, the same for a call and its result). Any other
template (the embedded SmolLM2's knows no tools) gets the generic tool prompt: a system section
listing each function with the JSON schema of its arguments and the call format, earlier calls
written into the assistant's text in that format, and results as user turns in ``<tool_response>``
tags. ``tool_choice: none`` renders no tools at all.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from cachegw.backend.core.sampling_params import StructuredOutput
from cachegw.backend.entrypoints.tool_parser import HERMES, ID_ALPHABET, LLAMA3, MISTRAL, ToolFormat
from cachegw.backend.entrypoints.tools import ToolRequest, tool_request
from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import ChatCompletionRequest, ChatMessage


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
    """The tool format the model's own chat template renders and expects, if it has one we read:
    told apart by what each family's template writes (Hermes' ``<tool_call>``, Mistral's
    ``[TOOL_CALLS]``, Llama 3.1+'s ``ipython`` role or ``<|python_tag|>`` with ``"parameters"``)."""
    template = getattr(tokenizer, "chat_template", None)
    text = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    if "tools" not in text:
        return None
    if HERMES.open.strip() in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if ("ipython" in text or "<|python_tag|>" in text) and '"parameters"' in text:
        return LLAMA3
    return None


def _special_markers(tokenizer: Any, fmt: ToolFormat) -> tuple[tuple[str, int], ...]:
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return tuple((m, int(tokenizer.convert_tokens_to_ids(m))) for m in fmt.markers if m in special)


def request_tools(req: ChatCompletionRequest, tokenizer: Any) -> ToolRequest | None:
    """The request's tool fields, in the format the model's template uses (else the generic prompt's)."""
    tools = tool_request(req.model_extra or {})
    if tools is None or not tools.calls_possible:
        return tools
    if req.response_format is not None and req.response_format.type != "text":
        tools = replace(tools, answers_json=True)
    fmt = template_format(tokenizer)
    if fmt is None:
        return tools
    return replace(tools, format=fmt, templated=True, special=_special_markers(tokenizer, fmt))


def answer_constraint(tools: ToolRequest | None, answer: StructuredOutput | None) -> StructuredOutput | None:
    """What the output must be, given the tools and the response_format's constraint ``answer``."""
    return answer if tools is None else tools.grammar(answer)


def template_call_id(call_id: str | None, fmt: ToolFormat) -> str | None:
    """The id a template gets for a call: as sent, or for a format with fixed ids (Mistral's 9 letters
    and digits) the id itself when it fits, else one derived from it (the same for a call and its result)."""
    if not fmt.id_length or call_id is None:
        return call_id
    if len(call_id) == fmt.id_length and all(c in ID_ALPHABET for c in call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = ""
    for _ in range(fmt.id_length):
        digest, r = divmod(digest, len(ID_ALPHABET))
        out += ID_ALPHABET[r]
    return out


def generic_tool_section(req: ToolRequest) -> str:
    """The system prompt's tool section for a model whose template knows no tools."""
    fmt = req.format
    listed = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in req.functions)
    example = fmt.call_text("function_name", '{"argument": "value"}')
    if req.mode == "named":
        rule = f"You must call the function {req.named}."
    elif req.mode == "required":
        rule = "You must call at least one function."
    elif req.answers_json:
        rule = "If no function helps with the request, answer with the JSON asked for instead."
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


def _templated(messages: list[ChatMessage], fmt: ToolFormat) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = dict(m.template_dict())
        if m.role == "assistant" and m.tool_calls:
            item["tool_calls"] = [
                {"id": template_call_id(c.id, fmt), "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in _calls(m, i)
            ]  # fmt: skip
        elif m.role == "tool" and m.tool_call_id is not None:
            item["tool_call_id"] = template_call_id(m.tool_call_id, fmt)
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


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage], req: ToolRequest | None, generation_prompt: bool = True
) -> list[int]:
    """The prompt's token ids; ApiError(400) if the template rejects the conversation. Without the
    generation prompt: a prefix of the conversation, as a pin measures it (``pin_fields.py``)."""
    templated = template_format(tokenizer)
    kwargs: dict[str, Any] = {}
    if templated is not None:
        conversation = _templated(messages, templated)
        if req is not None and req.calls_possible:
            kwargs["tools"] = [f.openai() for f in req.functions]
    else:
        conversation = _generic(messages, req, req.format if req else HERMES)
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
    except Exception as exc:  # template errors are the request's fault (roles, order...)
        raise ApiError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    return list(ids)
