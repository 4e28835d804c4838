"""A configuration reference rendered from the section models and config.toml's defaults (Markdown).

Generic: the caller passes the root model (one field per section) and the parsed defaults file;
``gateway/offline/config_docs.py`` writes docs/config.md with it (``make config-docs``), and a test keeps that
file in step. A key without a description, or a key of the file no model has (or the reverse), is an
error: a key added without its doc line fails there.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models inside an annotation (``tuple[BackendSpec, ...]``, ``dict[str, ModelPrice]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def type_name(annotation: Any) -> str:
    """A TOML-minded name of a field's type: ``"a" | "b"``, ``list of str``, ``table of float``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " (optional)"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is tuple or origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"table of {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    name = getattr(annotation, "__name__", str(annotation))
    return {"SecretStr": "str (secret)"}.get(name, name)


def _bounds(info: FieldInfo) -> str:
    found = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return ", ".join(found)


def toml_value(value: Any) -> str:
    """A default as it would be written in config.toml."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[]" if not value else f"[{len(value)} entries]"
    if isinstance(value, dict):
        return (
            "{}" if not value else "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
        )
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(fields: Mapping[str, FieldInfo], defaults: Mapping[str, Any] | None, where: str) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, info in fields.items():
        if not info.description:
            raise ValueError(f"{where} {name}: no description (Field(description=...))")
        if defaults is not None:
            default = toml_value(defaults[name])
        elif info.is_required():
            default = "(required)"
        else:
            default = toml_value(info.get_default(call_default_factory=True))
        bounds = _bounds(info)
        meaning = info.description + (f" ({bounds})" if bounds else "")
        rows.append(
            f"| `{name}` | {_cell(type_name(info.annotation))} | `{_cell(default)}` | {_cell(meaning)} |"
        )
    return rows


def _is_table(info: FieldInfo) -> bool:
    return isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)


def _doc(model: type[BaseModel]) -> list[str]:
    return [" ".join((model.__doc__ or "").split()), ""] if model.__doc__ else []


def _section(model: type[BaseModel], defaults: Mapping[str, Any], path: str) -> list[str]:
    """A section's own keys, the tables its entries are (``backends = [{url = ...}]``), then its
    sub-tables (fields that are models of their own, ``[cache.encoder]``)."""
    own = {n: i for n, i in model.model_fields.items() if not _is_table(i)}
    unknown, missing = set(defaults) - set(model.model_fields), set(own) - set(defaults)
    if unknown or missing:
        raise ValueError(
            f"[{path}]: config.toml keys {sorted(unknown)} are in no model; {sorted(missing)} not in the file"
        )
    lines = [f"## `[{path}]`", "", *_doc(model), *_table(own, defaults, f"[{path}]"), ""]
    for name, info in own.items():
        for entry in _models(info.annotation):
            lines += [f"### Entries of `[{path}] {name}`", "", *_doc(entry)]
            lines += [*_table(entry.model_fields, None, f"[{path}] {name}"), ""]
    for name, info in model.model_fields.items():
        if _is_table(info):
            lines += _section(info.annotation, defaults.get(name, {}), f"{path}.{name}")  # type: ignore[arg-type]
    return lines


def render(root: type[BaseModel], defaults: Mapping[str, Any], header: str) -> str:
    """The reference: ``header``, then each section of ``defaults`` (config.toml, in its order) with
    its keys' types, defaults and meanings from ``root``'s fields."""
    unknown = set(defaults) - set(root.model_fields)
    if unknown:
        raise ValueError(f"config.toml sections {sorted(unknown)} are in no model")
    lines = [header.rstrip(), ""]
    for name, table in defaults.items():
        info = root.model_fields[name]
        lines += _section(info.annotation, table, name)  # type: ignore[arg-type]
    return "\n".join(lines).rstrip() + "\n"
