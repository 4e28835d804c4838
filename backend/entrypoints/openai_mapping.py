"""The engine's side of the OpenAI wire format: request fields to SamplingParams, and the pieces
of responses (usage, logprobs) built from engine outputs. The shared models and errors live in
the ``protocol`` package."""

from __future__ import annotations

import json
from typing import Any

from cachegw.backend.core.outputs import RequestOutput
from cachegw.backend.core.sampling_params import (
    InvalidParameter,
    SamplingParams,
    StructuredOutput,
    parse_logit_bias,
)
from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import GenerationRequest, ResponseFormat


def invalid_parameter(exc: InvalidParameter) -> ApiError:
    return ApiError(getattr(exc, "status", 400), str(exc), param=exc.param, code=getattr(exc, "code", None))


def sampling_params(req: GenerationRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Raises InvalidParameter naming the bad field."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    echo = bool(getattr(req, "echo", False))  # /v1/completions only
    if req.stream and (getattr(req, "best_of", None) or 1) > (req.n or 1):
        raise InvalidParameter(
            "best_of", "best_of > n cannot be streamed (as OpenAI): leave out stream or best_of"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        n=1 if req.n is None else req.n,
        best_of=getattr(req, "best_of", None),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=parse_logit_bias(req.logit_bias or {}),
        echo=echo,
        prompt_logprobs=logprobs if echo else None,
        structured=structured_output(req.response_format),
        priority=req.priority or 0,
        draft=req.cachegw_draft,
    )


def structured_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """``response_format`` as the engine enforces it; None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        # No schema at all (OpenAI allows it) means any JSON value.
        schema = {} if fmt.json_schema.schema_ is None else fmt.json_schema.schema_
        return StructuredOutput.json_schema(schema, fmt.json_schema.strict)
    raise InvalidParameter(
        "response_format.type",
        f"response_format type {fmt.type!r} is not supported by this server: use 'text', "
        "'json_object' or 'json_schema'",
    )


def usage(out: RequestOutput) -> dict[str, Any]:
    """The prompt once, and every sample's tokens (best_of's discarded ones too, as OpenAI bills)."""
    prompt = len(out.prompt_token_ids)
    completion = out.num_generated_tokens or sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": out.num_cached_tokens,
            "pinned_tokens": out.num_pinned_tokens,  # held by pins now (backend/core/pins.py)
        },
    }


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2's public scheme: every byte a printable char)."""
    spans = ((ord("!"), ord("~")), (ord("¡"), ord("¬")), (ord("®"), ord("ÿ")))
    table = {chr(b): b for lo, hi in spans for b in range(lo, hi + 1)}
    shifted = (b for b in range(256) if b not in table.values())
    for i, b in enumerate(shifted):
        table[chr(256 + i)] = b
    return table


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for logprobs.

    Decoding one token alone cannot show a piece of a multi-byte character, so byte-level
    vocabularies are read byte by byte: ``bytes`` is then exact, as OpenAI reports it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._bytes is not None and isinstance(piece, str) and all(c in self._bytes for c in piece):
            raw = bytes(self._bytes[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def _is_byte_level(tokenizer: Any) -> bool:
    try:  # the decoder's own JSON: the whole tokenizer's (to_str) is MiBs of Python objects in passing
        decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__()) or {}
    except Exception:  # slow tokenizer or no tokenizer or decoder: fall back to decoding
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


def _lp(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def chat_logprobs(entries: list[dict], texts: TokenTexts, top: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or chunk) for these tokens."""
    content = []
    for e in entries:
        token, raw = texts.get(e["token_id"])
        alternatives = []
        for token_id, lp in e["top"][:top]:
            t, b = texts.get(token_id)
            alternatives.append({"token": t, "logprob": _lp(lp), "bytes": b})
        content.append(
            {"token": token, "logprob": _lp(e["logprob"]), "bytes": raw, "top_logprobs": alternatives}
        )
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict], texts: TokenTexts, offset: int) -> tuple[dict[str, Any], int]:
    """``choices[i].logprobs`` of a completion for these tokens, and the text offset after them.

    Offsets count from the start of the generated text (there is no echo).
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        token = texts.get(e["token_id"])[0]
        alternatives = {token: _lp(e["logprob"])}
        for token_id, lp in e["top"]:
            alternatives.setdefault(texts.get(token_id)[0], _lp(lp))
        tokens.append(token)
        token_logprobs.append(_lp(e["logprob"]))
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(token)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


def echo_logprobs(
    prompt_ids: list[int], entries: list[dict | None], texts: TokenTexts
) -> tuple[dict[str, Any], int]:
    """The prompt's part of an echoed completion's ``logprobs`` (the first token has none, as
    OpenAI answers), and the text offset after its tokens."""
    first = texts.get(prompt_ids[0])[0]
    scored = [e for e in entries[1:] if e is not None]
    rest, offset = completion_logprobs(scored, texts, len(first))
    body = {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }
    return body, offset


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Prompt logprobs followed by the completion's."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}
