"""JSON schemas the structured-output tests and bench/structured_output.py both ask for: strings bounded
(maxLength, enums, maxItems) so a 135M model always reaches the end of the object well within max_tokens."""

from __future__ import annotations


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object", "properties": properties,
        "required": list(properties) if required is None else required, "additionalProperties": False,
    }  # fmt: skip


NAME = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "nested": (
        "Give the capital of France and its population as JSON.",
        obj({"city": obj({"name": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 10**8}})}),
    ),
    "array": (
        "List the colours of the French flag as JSON.",
        obj({"colors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    ),
    "enum": (
        "Is the review 'I loved this film' positive or negative? Answer as JSON.",
        obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "stars": {"type": "integer",
                                                                              "minimum": 1, "maximum": 5}}),
    ),
    "bounds": (
        "Describe a student as JSON: age and grade average.",
        obj({"age": {"type": "integer", "minimum": 18, "maximum": 30},
             "average": {"type": "number", "minimum": 0, "maximum": 20}, "enrolled": {"type": "boolean"}}),
    ),
    "optional": (
        "Describe a cat as JSON with a name.",
        obj({"name": NAME, "nickname": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 30}},
            required=["name"]),
    ),
}  # fmt: skip
