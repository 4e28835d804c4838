"""A small OpenAI-compatible backend that answers with tool calls, for the gateway's tests.

Its calls are labelled (the arguments come from the question), which the built-in engine's 135M
model cannot promise, so most of the gateway's tool-call tests put this server behind the gateway.
It answers a request that offers ``tools`` with one call of the first tool, its arguments taken from
the user's message, as JSON or as a stream whose arguments arrive in several pieces (the id, type and
name only in the first delta, as OpenAI and vLLM send them). A turn that ends with a tool result, or
offers no tools, gets a text answer numbered by how many requests the server has answered, so a test
can tell which backend call an answer came from.

Model ``tools-stop`` ends tool-call answers with finish_reason ``stop`` instead (vLLM, llama.cpp and
Ollama do); model ``tools-vllm`` sends vLLM's empty ``tool_calls: []`` and ``reasoning_content:
null`` with its text answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODELS = ("tools", "tools-stop", "tools-vllm")
ARGUMENT_PIECES = 4  # a streamed call's arguments are cut into this many chunks


@dataclass
class Calls:
    """What the backend was asked, in order (the last message's content)."""

    seen: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seen)


def weather_tool(name: str = "get_weather") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }


def _answer(body: dict[str, Any], n: int) -> tuple[dict[str, Any], str]:
    """(message, finish_reason) for this request."""
    messages = body["messages"]
    last = messages[-1]
    tools = body.get("tools") or []
    if tools and last.get("role") == "user":
        city = str(last.get("content")).rstrip("?.!").split()[-1]
        arguments = json.dumps({"city": city, "unit": "celsius"})
        call = {
            "id": f"call_backend{n:04d}",
            "type": "function",
            "function": {"name": tools[0]["function"]["name"], "arguments": arguments},
        }
        finish = "stop" if body["model"] == "tools-stop" else "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": [call]}, finish
    if last.get("role") == "tool":
        text = f"The tool said {last.get('content')} (answer {n})."
    else:
        text = f"Plain answer {n} to: {last.get('content')}"
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if body["model"] == "tools-vllm":
        message |= {"tool_calls": [], "reasoning_content": None}
    return message, "stop"


def _chunks(body: dict[str, Any], message: dict[str, Any], finish: str, n: int) -> list[dict[str, Any]]:
    head = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    out = [chunk({"role": "assistant", "content": None if message.get("tool_calls") else ""})]
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        first = {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"]}}
        out.append(chunk({"tool_calls": [first]}))
        args, size = fn["arguments"], -(-len(fn["arguments"]) // ARGUMENT_PIECES)
        for start in range(0, len(args), size):
            out.append(
                chunk({"tool_calls": [{"index": i, "function": {"arguments": args[start : start + size]}}]})
            )
    if message.get("content"):
        words = message["content"].split(" ")
        out += [chunk({"content": w + (" " if i < len(words) - 1 else "")}) for i, w in enumerate(words)]
    out.append(chunk({}, finish))
    out.append({**head, "choices": [], "usage": _usage()})
    return out


def _usage() -> dict[str, int]:
    return {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}


def tool_backend(calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "test"} for m in MODELS]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        calls.seen.append(body["messages"][-1].get("content"))
        n = len(calls)
        message, finish = _answer(body, n)
        if body.get("stream"):
            events = [f"data: {json.dumps(c)}\n\n".encode() for c in _chunks(body, message, finish, n)]

            async def stream():
                for event in events:
                    yield event
                yield b"data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": _usage(),
            }
        )

    return app
