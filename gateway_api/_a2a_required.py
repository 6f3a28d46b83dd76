"""The A2A spec's REQUIRED fields (the `google.api.field_behavior` its proto marks them with),
checked on a parsed request as the a2a-sdk's `validate_proto_required_fields` checks them, with
each message type's fields read once: the SDK reads every field's options on every call
(~0.4 ms a SendMessage, the front's largest cost; tests/unit/test_a2a_front.py compares the
two).
"""

from __future__ import annotations

from typing import Any

from google.api.field_behavior_pb2 import (  # type: ignore[import-untyped]
    FieldBehavior,
    field_behavior,
)
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# Types that hold no REQUIRED field, and whose values can nest deeply (metadata, data parts).
_LEAVES = frozenset(
    {
        "google.protobuf.Struct",
        "google.protobuf.Value",
        "google.protobuf.ListValue",
        "google.protobuf.Timestamp",
    }
)
# Per message type: (field, required, look inside, repeated) for the fields worth a look.
_Plan = tuple[tuple[FieldDescriptor, bool, bool, bool], ...]
_PLANS: dict[str, _Plan] = {}


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 6.31+ has `is_repeated`; earlier ones only `label`.
    found = getattr(field, "is_repeated", None)
    if found is not None:
        return bool(found)
    return bool(getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED)


def _plan(descriptor: Any, seen: frozenset[str] = frozenset()) -> _Plan:
    found = _PLANS.get(descriptor.full_name)
    if found is not None:
        return found
    seen = seen | {descriptor.full_name}
    plan = []
    for field in descriptor.fields:
        required = FieldBehavior.REQUIRED in field.GetOptions().Extensions[field_behavior]
        nested = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
        inside = (
            nested is not None
            and nested.full_name not in _LEAVES
            and not nested.GetOptions().map_entry
            and (nested.full_name in seen or bool(_plan(nested, seen)))
        )
        if required or inside:
            plan.append((field, required, inside, _repeated(field)))
    _PLANS[descriptor.full_name] = tuple(plan)
    return _PLANS[descriptor.full_name]


def _unset(message: Message, field: FieldDescriptor, value: Any, repeated: bool) -> bool:
    if repeated:
        return not value
    if field.has_presence:
        return not message.HasField(field.name)
    return bool(value == field.default_value)


def missing(message: Message, prefix: str = "") -> list[str]:
    """`field: why` for every REQUIRED field of `message` (and of the messages in it) that is
    not set."""
    problems: list[str] = []
    for field, required, inside, repeated in _plan(message.DESCRIPTOR):
        value = getattr(message, field.name)
        name = f"{prefix}{field.name}"
        if required and _unset(message, field, value, repeated):
            why = "must contain at least one element" if repeated else "required"
            problems.append(f"{name}: {why}")
        if inside:
            if repeated:
                for index, item in enumerate(value):
                    problems += missing(item, f"{name}[{index}].")
            elif message.HasField(field.name):
                problems += missing(value, f"{name}.")
    return problems
