"""Cacheability: may this request be answered from the cache, and may its fresh answer be stored?

Called first, before any lookup. A stored answer is one choice of one completion, with no
logprobs; it may only answer a request for which that is a faithful reply, and it is only worth
storing if an identical request could be served from it. The first row that applies decides:

| # | request | serve | store | reason |
|---|---|---|---|---|
| 1 | ``CachePolicy.enabled`` is false | no | no | disabled |
| 2 | n, temperature, top_k, logprobs, top_logprobs of a wrong type or range | no | no | invalid |
| 3 | ``Cache-Control: no-store`` | no | no | no-store |
| 4 | ``n`` > 1, or a completions ``prompt`` list of several prompts | no | no | n>1 |
| 5 | chat ``logprobs: true`` or ``top_logprobs`` set; completions ``logprobs`` set | no | no | logprobs |
| 6 | sampling, unless the policy serves sampled answers or unset temperatures | no | no | temperature |
| 7 | ``Cache-Control: no-cache`` / ``max-age=0``; ``Pragma: no-cache`` alone | no | yes | no-cache |
| 8 | ``stream_options`` beyond ``include_usage`` / ``include_obfuscation`` | no | yes | stream-options |
| 9 | anything else | yes | yes | ok |

Rows 8 and 9 also carry the request's freshness limits: ``Cache-Control: max-age=N`` serves only
entries stored in the last N seconds, ``min-fresh=N`` only entries that stay fresh N more seconds.

Why:
2. the backend will answer 400; a cache must not answer what the backend refuses.
3. RFC 9111: nothing of this exchange may be kept.
4. an entry holds one choice; n copies of it are not n samples, nor one answer the answers to
   several prompts.
5. stored answers carry no logprobs.
6. sampling = temperature > 0 (absent or null = OpenAI's default 1.0), unless ``top_k`` = 1 (only
   the best token can be drawn, so it is greedy). The client asked for a fresh sample; and storing
   is useless, since an identical request could never be served from the entry. With
   ``serve_temperature_above_zero`` both are allowed; with ``serve_unset_temperature`` (the
   operator's trade-off for clients that never set it) both are allowed when temperature is absent
   or null.
7. RFC 9111: go to the origin (the backend); its fresh answer is still good to keep, and replaces
   the stored one (one live entry per exact key). ``Pragma``
   counts only when no Cache-Control is sent (RFC 9111 5.4).
8. a replayed stream cannot honour options we do not know (e.g. vLLM's per-chunk usage); the answer
   itself is ordinary, so it is stored.

Deliberately not rules:
- ``seed``: a seed does not make sampling cacheable on its own (OpenAI: best effort only); with
  ``serve_temperature_above_zero`` the seed is part of the exact key like any parameter.
- ``tool_choice`` ("required", a named function, "none"): the answer to an identical request, tools
  included, is the same tool call; the client still runs the tool itself. The gateway mints fresh
  tool-call ids when it serves one (``gateway/request/hits.py``).
- ``stream``: a stored answer can be replayed as a stream (usage chunk included).
- ``top_p``, ``stop``, ``max_tokens``, ``response_format``...: part of the key, not of this decision.
Headers are matched case-insensitively, repeated headers and comma lists are both read.

Exact tier only (``exact_only``): a turn whose last message is not a user's (a tool result, an
assistant prefill) has no question to compare by meaning; what the tool returned is data, and a
paraphrase of the conversation is not the same data. Such a turn hits only when it repeats exactly
(tool-call ids aside: ``policies/cache_keys.py`` keys them by position).

What answer may be stored (``judge_answer``), after the request may be: one choice that completed
well: finish_reason ``stop``, ``length`` (only for a request with a max_tokens, to be served to that
same limit), or ``tool_calls``; ``stop`` with tool calls counts too (vLLM, llama.cpp and Ollama say
``stop``). Every tool call must be whole: a function (type ``function``, or no type) with a name and
arguments that parse as JSON (a call cut short by ``length`` never does); its id may be missing, since
a replay mints a fresh one anyway. The message may carry nothing else than role,
content and tool calls (empty fields such as ``refusal: null`` or vLLM's ``tool_calls: []`` count as
absent): a refusal, reasoning or audio cannot be replayed as a stream. An answer with tool calls is
served to exact repeats only (``AnswerVerdict.semantic`` false): its arguments carry the values of
the user's own request (a city, an amount, an id), which a paraphrase may not share.

What stored answer may be served (``unservable``): one not flagged bad, not expired, within the
request's freshness limits, and that fits its max_tokens (``stop`` / ``tool_calls`` at most that long;
``length`` only for exactly the same limit). ``answer_length`` says how long an answer is known to be
when the backend sent no usage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

_KNOWN_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
_REPLAYABLE_FIELDS = frozenset({"role", "content", "tool_calls"})
COMPLETE_FINISHES = frozenset({"stop", "length", "tool_calls"})  # an answer that ended on its own


@dataclass(frozen=True)
class CachePolicy:
    """The parts of config.toml [cache] that decide cacheability; defaults equal the file's."""

    enabled: bool = True
    serve_temperature_above_zero: bool = False
    serve_unset_temperature: bool = False  # per request: the gateway resolves it per model and tenant

    @classmethod
    def from_dict(cls, cache_section: Mapping[str, Any]) -> CachePolicy:
        """From the whole [cache] section: its other keys belong to other parts and are ignored."""
        return cls(**{f.name: cache_section[f.name] for f in fields(cls) if f.name in cache_section})


@dataclass(frozen=True)
class Freshness:
    """The request's own limits (Cache-Control), on top of each entry's expiry."""

    max_age: float | None = None  # serve only entries at most this old (seconds)
    min_fresh: float = 0.0  # serve only entries that stay fresh this much longer


ANY_AGE = Freshness()  # no limit of the request's own


@dataclass(frozen=True)
class Cacheability:
    """The decision; ``reason`` is a short code the gateway counts requests by."""

    may_serve: bool
    may_store: bool
    reason: str
    fresh: Freshness = ANY_AGE

    @property
    def keeps_nothing(self) -> bool:
        """no-store: not even the reply text or the query in the request log may be kept."""
        return self.reason == "no-store"


OK = Cacheability(True, True, "ok")
_NEITHER = {r: Cacheability(False, False, r) for r in ("disabled", "invalid", "no-store", "n>1")}
_NEITHER |= {r: Cacheability(False, False, r) for r in ("logprobs", "temperature")}
_STORE_ONLY = {r: Cacheability(False, True, r) for r in ("no-cache", "stream-options")}


def decide(body: Mapping[str, Any], headers: Mapping[str, str], policy: CachePolicy) -> Cacheability:
    """Rows of the module table in order, most restrictive first; the first that applies wins."""
    if not policy.enabled:
        return _NEITHER["disabled"]
    if not _valid(body):
        return _NEITHER["invalid"]
    directives = _cache_directives(headers)
    if "no-store" in directives:
        return _NEITHER["no-store"]
    if (body.get("n") or 1) > 1 or _several_prompts(body.get("prompt")):
        return _NEITHER["n>1"]
    if _wants_logprobs(body):
        return _NEITHER["logprobs"]
    if _samples(body) and not _sampling_served(body, policy):
        return _NEITHER["temperature"]
    if "no-cache" in directives or directives.get("max-age") == "0":
        return _STORE_ONLY["no-cache"]
    options = body.get("stream_options")
    decision = OK
    if isinstance(options, Mapping) and set(options) - _KNOWN_STREAM_OPTIONS:
        decision = _STORE_ONLY["stream-options"]
    max_age, min_fresh = _seconds(directives.get("max-age")), _seconds(directives.get("min-fresh"))
    if max_age is not None or min_fresh:
        decision = replace(decision, fresh=Freshness(max_age, min_fresh or 0.0))
    return decision


def _seconds(value: str | None) -> float | None:
    """A delta-seconds directive value; anything else is ignored (RFC 9111 1.2.2)."""
    return float(value) if value is not None and value.isascii() and value.isdigit() else None


def _several_prompts(prompt: Any) -> bool:
    """A list of strings or of token lists with more than one element; a list of ints is one prompt."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    """An int, or a float like 2.0 (JSON does not tell them apart; the backend accepts both). An int
    is never converted to float: 10**400 would overflow."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


def _valid(body: Mapping[str, Any]) -> bool:
    """Only what this decision reads; every other field is the backend's to validate."""
    n, temp, top_k = body.get("n"), body.get("temperature"), body.get("top_k")
    top_logprobs, logprobs = body.get("top_logprobs"), body.get("logprobs")
    checks = (
        n is None or (_integer(n) and n >= 1),
        temp is None or (_number(temp) and temp >= 0),
        top_k is None or _integer(top_k),
        top_logprobs is None or _integer(top_logprobs),
        logprobs is None or isinstance(logprobs, bool) or (_integer(logprobs) and "messages" not in body),
    )
    return all(checks)


def _wants_logprobs(body: Mapping[str, Any]) -> bool:
    """Chat: a bool (+ top_logprobs). Completions: an int, where 0 still asks for the chosen token's."""
    if body.get("top_logprobs") is not None:
        return True
    logprobs = body.get("logprobs")
    if "messages" in body:
        return logprobs is True
    return logprobs is not None and logprobs is not False


def _sampling_served(body: Mapping[str, Any], policy: CachePolicy) -> bool:
    if policy.serve_temperature_above_zero:
        return True
    return policy.serve_unset_temperature and body.get("temperature") is None


def _samples(body: Mapping[str, Any]) -> bool:
    """True unless decoding is greedy: temperature 0, or top_k 1 (only the best token can be drawn)."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0  # OpenAI's default; an explicit null means the same
    return temperature > 0 and body.get("top_k") != 1


def _cache_directives(headers: Mapping[str, str]) -> dict[str, str]:
    """Request Cache-Control directives, lower-cased (name -> value, "" if none), or Pragma's no-cache."""
    cache_control: list[str] = []
    pragma: list[str] = []
    for name, value in headers.items():
        lowered = name.lower()
        if lowered == "cache-control":
            cache_control.append(value)
        elif lowered == "pragma":
            pragma.append(value)
    out: dict[str, str] = {}
    for part in ",".join(cache_control or pragma).split(","):
        key, _, val = part.strip().partition("=")
        if key.strip():
            out[key.strip().lower()] = val.strip().strip('"')
    if not cache_control:
        out = {"no-cache": ""} if "no-cache" in out else {}
    return out


@dataclass(frozen=True)
class AnswerVerdict:
    """May this answer be stored, and may a paraphrase (not only an exact repeat) be served it."""

    store: bool
    reason: str  # "ok", or why not: "choices", "finish:<reason>", "field:<name>", "tool-call"
    semantic: bool = True


def exact_only(body: Mapping[str, Any]) -> bool:
    """True when the last message is not a user's (a tool result, an assistant prefill): no semantic
    lookup, only an exact repeat may be served."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    last = messages[-1]
    return isinstance(last, Mapping) and last.get("role") != "user"


def judge_answer(response: Mapping[str, Any], max_tokens: int | None) -> AnswerVerdict:
    """The module's storage rules for a completed answer (JSON, or a stream rebuilt as JSON)."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        return AnswerVerdict(False, "choices")
    choice = choices[0]
    finish = choice.get("finish_reason")
    message = choice.get("message") or {}
    if not isinstance(message, Mapping):
        return AnswerVerdict(False, "field:message")
    calls = message.get("tool_calls") or []
    if finish not in COMPLETE_FINISHES or (finish == "length" and (max_tokens is None or calls)):
        return AnswerVerdict(False, f"finish:{finish}")
    for key, value in message.items():
        if key not in _REPLAYABLE_FIELDS and value not in (None, "", [], {}):
            return AnswerVerdict(False, f"field:{key}")
    if finish == "tool_calls" and not calls:
        return AnswerVerdict(False, "tool-call")
    if not isinstance(calls, list) or not all(_whole_call(c) for c in calls):
        return AnswerVerdict(False, "tool-call")
    return AnswerVerdict(True, "ok", semantic=not calls)


def _whole_call(call: Any) -> bool:
    """A function call as OpenAI shapes it, its arguments complete JSON."""
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        return False
    fn = call.get("function")
    if not isinstance(call.get("id", ""), str) or not isinstance(fn, Mapping):
        return False
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, str):
        return False
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


UNKNOWN_LENGTH = 2**31 - 1  # completion_tokens of an answer stored without usage: no limit is known to hold


class StoredAnswer(Protocol):
    """What ``unservable`` reads of a stored answer (the gateway's ``CacheEntry`` has these)."""

    @property
    def bad(self) -> bool: ...
    @property
    def expires_at(self) -> float: ...
    @property
    def created_at(self) -> float: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int | None: ...


def unservable(
    answer: StoredAnswer, max_tokens: int | None, now: float, fresh: Freshness = ANY_AGE
) -> str | None:
    """Why a stored answer may not answer a request asking for ``max_tokens`` (a miss reason), or
    None when it may."""
    if answer.bad:
        return "flagged"
    if answer.expires_at <= now:
        return "expired"
    if answer.expires_at - fresh.min_fresh <= now or (
        fresh.max_age is not None and now - answer.created_at > fresh.max_age
    ):
        return "too-old"  # for the request's Cache-Control max-age / min-fresh
    if answer.finish_reason in ("stop", "tool_calls"):
        fits = max_tokens is None or answer.completion_tokens <= max_tokens
        return None if fits else "too-long"
    if answer.finish_reason == "length":  # truncated: only for exactly the same limit
        same = max_tokens is not None and max_tokens == answer.max_tokens
        return None if same else "truncated"
    return "not-servable"


def answer_length(usage: Mapping[str, Any], max_tokens: int | None, finish: str) -> int:
    """The answer's length, which decides which max_tokens it may be served to. A backend that sent no
    usage leaves only what its own limit proves: a "stop" (or "tool_calls") answer fit the max_tokens
    it was asked with."""
    n = usage.get("completion_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    ended = finish in ("stop", "tool_calls")
    return max_tokens if max_tokens is not None and ended else UNKNOWN_LENGTH
