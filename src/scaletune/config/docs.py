"""The config reference, generated from the schema: one table per section with each key's type,
default and docstring (`docs/config.md`, `scaletune config reference`)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from scaletune.config.schema import Config


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a stage's field: the main model's type with its constraints
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return "(section defaults)"
        return "`[]`" if value == [] else "`{}`" if value == {} else f"`{value!r}`"
    value = info.default
    if value is PydanticUndefined:
        return "required"
    return "`null`" if value is None else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _sections(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """Depth-first list of (dotted prefix, model) for `model` and every section below it."""
    out = [(prefix, model)]
    for name, info in model.model_fields.items():
        for arg in (info.annotation, *typing.get_args(info.annotation)):
            inner = typing.get_args(arg) if typing.get_origin(arg) is list else (arg,)
            for t in inner:
                if isinstance(t, type) and issubclass(t, BaseModel):
                    key = f"{prefix}.{name}" if prefix else name
                    if typing.get_origin(arg) is list:
                        key += "[]"
                    out += _sections(t, key)
    return out


def reference_markdown() -> str:
    """The whole reference as Markdown (the text of docs/config.md)."""
    lines = [
        "# Config reference",
        "",
        "Generated from `src/scaletune/config/schema.py` by `scaletune config reference`; a test fails",
        "when this file is stale. Every key is optional unless marked required; unknown keys are errors.",
        "Cross-field rules (which combinations are refused, and why) run when a run is resolved",
        "(`src/scaletune/resolve/rules.py`); `scaletune config show CONFIG` prints a config with every default",
        "filled in and the decisions taken.",
        "",
    ]
    for prefix, model in _sections(Config, ""):
        title = prefix or "top level"
        lines += [f"## `{title}`" if prefix else "## top level", ""]
        doc = (model.__doc__ or "").strip()
        if doc:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, info in model.model_fields.items():
            desc = " ".join((info.description or "").split()).replace("|", "\\|")
            lines.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {desc} |")
        lines.append("")
    return "\n".join(lines)
