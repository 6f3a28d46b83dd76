"""What an operation tells Reach about its input: a JSON Schema and a description (sent at Join,
listed by Reach's MCP front as the tool's `inputSchema` and `description`).

Derived from the handler when not given (`@runtime.operation(..., input_schema=...,
description=...)` wins):

- the description is the handler's docstring (its first 4096 characters);
- the schema is that of the payload parameter's annotation: a pydantic model (the handler is
  then handed the validated model instance, and a payload that does not fit is refused with
  422 `invalid_request` naming the field, before the handler runs), a `TypedDict` (fields may
  be `Annotated[int, Field(ge=1, description=...)]`; before Python 3.12, `typing_extensions`'
  TypedDict, which pydantic reads), or a `dict[str, T]`. A bare `dict`,
  `dict[str, Any]`, `Any` or no annotation says nothing: the payload is then any JSON object;
  so does a model or TypedDict with a field JSON Schema cannot describe (an arbitrary class, a
  callable). A recursive one's root definition is written at the schema's root, beside its
  `$defs` (pydantic writes a bare `$ref` there, which is not an object's schema).

Read once at registration, from the handler's own annotations (the strings that
`from __future__ import annotations` leaves are resolved in its module), so serving a request
costs nothing more. A schema that is not an object's, or that is bigger or deeper than Reach
takes (64 KiB, 32 levels), is a `ValueError` at registration rather than a refused Join.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, PydanticUserError, TypeAdapter
from typing_extensions import is_typeddict  # both typing's TypedDict and its own

# reach.registry.models' bound (its import, ~30 ms of the registry's models, is left to
# `checked`, which only an operation with a schema needs).
MAX_DESCRIPTION_CHARS = 4096
_ANY_OBJECT = ({"type": "object"}, {"type": "object", "additionalProperties": True})


def description_of(func: Callable[..., Any]) -> str | None:
    doc = inspect.getdoc(func)
    if not doc:
        return None
    return doc[:MAX_DESCRIPTION_CHARS]


def payload_annotation(func: Callable[..., Any]) -> Any:
    """The payload parameter's annotation, resolved (None when it has none)."""
    target = func if inspect.isfunction(func) or inspect.ismethod(func) else func.__call__  # type: ignore[operator]
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if not params or params[0].annotation is inspect.Parameter.empty:
        return None
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # a forward reference that does not resolve: say nothing
        return None
    return hints.get(params[0].name)


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model the payload is validated into, when the handler takes one."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return None


def schema_of(annotation: Any) -> dict[str, Any] | None:
    if annotation is None or annotation is Any or annotation is dict:
        return None
    model = model_of(annotation)
    origin = typing.get_origin(annotation)
    if model is None and not is_typeddict(annotation) and origin is not dict:
        return None
    try:
        if model is not None:
            return _inlined(model.model_json_schema())
        schema = TypeAdapter(annotation).json_schema()
    except PydanticUserError:
        # A type JSON Schema cannot say (an arbitrary class, a callable: the model still
        # validates), or typing.TypedDict before Python 3.12 (typing_extensions' is read).
        return None
    # dict[str, Any] says no more than a bare dict: any object.
    return None if schema in _ANY_OBJECT else _inlined(schema)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema whose root is only a reference into its `$defs` (what pydantic writes for a
    recursive model or TypedDict) with that definition at its root, `$defs` kept beside it so
    the references inside still resolve: the root must say `"type": "object"`."""
    ref = schema.get("$ref")
    defs = schema.get("$defs")
    prefix = "#/$defs/"
    if set(schema) != {"$ref", "$defs"} or not isinstance(ref, str) or not isinstance(defs, dict):
        return schema
    root = defs.get(ref[len(prefix) :]) if ref.startswith(prefix) else None
    return {**root, "$defs": defs} if isinstance(root, dict) else schema


def checked(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The schema as Reach will take it at Join, else a `ValueError` that says why."""
    from reach.registry.models import (
        MAX_INPUT_SCHEMA_BYTES,
        MAX_INPUT_SCHEMA_DEPTH,
        OperationDeclaration,
    )

    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(
            f"the input_schema of operation {name!r} must be a JSON Schema object whose "
            '"type" is "object" (a payload is always a JSON object)'
        )
    try:
        OperationDeclaration(name=name, input_schema=json.loads(json.dumps(schema)))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the input_schema of operation {name!r} is not one Reach takes (at most "
            f"{MAX_INPUT_SCHEMA_BYTES} bytes as JSON, {MAX_INPUT_SCHEMA_DEPTH} levels deep, "
            f"standard JSON): {exc}"
        ) from None
    return schema
