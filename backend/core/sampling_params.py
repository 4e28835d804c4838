"""What a request asks of generation, validated once on arrival."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cachegw.backend.core.pins import PinRequest

if TYPE_CHECKING:
    from cachegw.backend.core.lora_ref import LoRARef


class InvalidParameter(ValueError):
    """A bad request value; ``param`` names it so the server can answer in OpenAI's error shape."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


ANY_OBJECT = '{"type": "object"}'
GREEDY_TEMPERATURE = 1e-5  # vLLM's epsilon too
MAX_TOP_K = 2**31 - 1  # larger means "all tokens" anyway; a tensor of it must not overflow
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PRIORITY = 1000  # |priority|: bounded, so the scheduler's ageing bounds every wait (scheduler.py)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be: any JSON object, or JSON valid against ``schema`` (its JSON text), or
    (kind ``lark``) text of the llguidance Lark grammar in ``schema``: how tool calls are enforced.

    ``strict`` False lets the compiler skip schema keywords it does not implement instead of
    refusing the schema; True (OpenAI's strict mode) refuses them with a 400.
    """

    kind: Literal["json_object", "json_schema", "lark"]
    schema: str = ANY_OBJECT
    strict: bool = True
    embedded: StructuredOutput | None = None  # the response_format beside tools: compiled (checked) first

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool | None) -> StructuredOutput:
        # Key order is kept: the output lists properties in the schema's order.
        return cls("json_schema", json.dumps(schema), bool(strict))

    @classmethod
    def lark(cls, grammar: str, embedded: StructuredOutput | None = None) -> StructuredOutput:
        return cls("lark", grammar, embedded=embedded)

    @property
    def param(self) -> str:
        """The request field a bad grammar of this kind comes from."""
        return "tools" if self.kind == "lark" else "response_format"


@dataclass
class SamplingParams:
    """Sampling settings of one request. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the k most likely
    n: int = 1  # samples returned
    best_of: int | None = None  # samples drawn (>= n); the n with the highest cumulative logprob return
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob plus the top k
    echo: bool = False  # the prompt is part of the answer, so max_tokens 0 (scoring only) is valid
    structured: StructuredOutput | None = None  # response_format json_object / json_schema
    skip_special_tokens: bool = True  # False: the text keeps them (a tool format's [TOOL_CALLS])
    # Scheduling, not sampling (vLLM's `priority`): lower is scheduled first, 0 the default. Carried
    # here because these are the request's parameters every sample (Sequence) holds.
    priority: int = 0
    # A guess at the output (``cachegw_draft``): speculative decoding's first proposal source. It
    # can only make decoding faster or slower, never change what is generated.
    draft: str | None = None
    # Prompt prefixes to keep in the KV cache after this request (``backend/core/pins.py``).
    pins: tuple[PinRequest, ...] = ()
    # The LoRA adapter the request runs under (``backend/core/lora_ref.py``), None for the base model.
    lora: LoRARef | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = parse_logit_bias(self.logit_bias)
        least_tokens = 0 if self.echo else 1
        checks = [
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= least_tokens,
                f"must be an integer >= {least_tokens}",
            ),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            (
                "top_k",
                isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K,
                f"must be -1 (off) or between 0 and {MAX_TOP_K}",
            ),
            ("draft", self.draft is None or isinstance(self.draft, str), "must be a string"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            (
                "stop",
                len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
                "must be at most 16 non-empty strings",
            ),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative integers",
            ),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "must be between 0 and 20",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                "must be between 0 and 20",
            ),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            (
                "best_of",
                self.best_of is None or (isinstance(self.best_of, int) and self.best_of >= self.n),
                "must be an integer >= n",
            ),
            (
                "priority",
                isinstance(self.priority, int) and -MAX_PRIORITY <= self.priority <= MAX_PRIORITY,
                f"must be an integer between {-MAX_PRIORITY} and {MAX_PRIORITY}",
            ),
            (
                "presence_penalty",
                -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                "must be between -2 and 2",
            ),
            (
                "frequency_penalty",
                -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                "must be between -2 and 2",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParameter(name, f"{name}={getattr(self, name)!r} is invalid: {why}")

    @property
    def num_samples(self) -> int:
        """Sequences drawn: best_of when given, else n."""
        return self.best_of or self.n

    @property
    def best_of_ranks(self) -> bool:
        """More samples are drawn than returned, ranked by their cumulative logprob."""
        return self.num_samples > self.n

    @property
    def penalized(self) -> bool:
        """Whether the sampler has anything to add to this row's logits (rows without pay nothing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Below GREEDY_TEMPERATURE a draw is the argmax in all but name, and far below it (1e-50)
        logits / temperature overflow float32 into NaN."""
        return self.temperature < GREEDY_TEMPERATURE


def parse_logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (JSON keys are strings) as token id -> bias; a bad entry names the param."""
    if not isinstance(bias, dict):
        raise InvalidParameter("logit_bias", "logit_bias must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        text = str(key)
        if isinstance(key, bool) or not (isinstance(key, int) or text.isdigit()):
            raise InvalidParameter(
                "logit_bias", f"logit_bias key {key!r} is not a token id (a non-negative integer)"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
        ):
            raise InvalidParameter(
                "logit_bias",
                f"logit_bias value {value!r} for token {text} must be a number between -100 and 100",
            )
        out[int(text)] = float(value)
    return out
