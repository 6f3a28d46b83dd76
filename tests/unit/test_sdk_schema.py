"""What `@runtime.operation` declares about an operation's input (pure: no gateway)."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.wire import Inbound
from reach.registry import models


class Query(BaseModel):
    text: str = Field(description="what to look for")
    top_k: int = Field(default=3, ge=1)


class Move(TypedDict):
    x: Annotated[int, Field(ge=0, description="columns")]
    y: int


def declared(runtime: AgentRuntime, name: str) -> dict[str, Any]:
    entry = next(
        e
        for e in runtime._dispatcher.join_operations()
        if isinstance(e, dict) and e["name"] == name
    )
    return entry


def test_a_pydantic_model_is_the_schema_and_the_docstring_the_description() -> None:
    runtime = AgentRuntime("search")

    @runtime.operation("query", idempotent=True)
    async def query(payload: Query) -> dict[str, Any]:
        """Search the index.

        Longer words."""
        return {}

    entry = declared(runtime, "query")
    assert entry["idempotent"] is True
    assert entry["description"] == "Search the index.\n\nLonger words."
    schema = entry["input_schema"]
    assert schema["type"] == "object"
    assert schema["required"] == ["text"]
    assert schema["properties"]["text"]["description"] == "what to look for"
    assert schema["properties"]["top_k"]["minimum"] == 1
    models.OperationDeclaration.model_validate(entry)  # what the gateway takes at Join


def test_annotated_typeddict_fields_and_a_dict_of_values() -> None:
    runtime = AgentRuntime("board")

    @runtime.operation("move")
    def move(payload: Move, ctx: Any) -> dict[str, Any]:
        return {}

    @runtime.operation("tally")
    def tally(payload: dict[str, int]) -> dict[str, Any]:
        return {}

    schema = declared(runtime, "move")["input_schema"]
    assert schema["properties"]["x"] == {
        "description": "columns",
        "minimum": 0,
        "title": "X",
        "type": "integer",
    }
    assert schema["required"] == ["x", "y"]
    assert declared(runtime, "tally")["input_schema"] == {
        "type": "object",
        "additionalProperties": {"type": "integer"},
    }


def test_an_untyped_or_plain_dict_handler_declares_nothing() -> None:
    runtime = AgentRuntime("plain")

    @runtime.operation("a")
    def a(payload):  # type: ignore[no-untyped-def]
        return {}

    @runtime.operation("b")
    def b(payload: dict) -> dict:  # type: ignore[type-arg]
        return {}

    @runtime.operation("c")
    def c(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return {}

    assert runtime._dispatcher.join_operations() == ["a", "b", "c"]


def test_explicit_schema_and_description_win_and_are_checked() -> None:
    runtime = AgentRuntime("given")
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}

    @runtime.operation("q", input_schema=schema, description="Ask.")
    async def q(payload: Query) -> dict[str, Any]:
        """Not this."""
        return {}

    assert declared(runtime, "q")["input_schema"] == schema
    assert declared(runtime, "q")["description"] == "Ask."
    with pytest.raises(ValueError, match='"type" is "object"'):
        runtime.operation("bad", input_schema={"type": "string"})
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"d": deep}}
    with pytest.raises(ValueError, match="32 levels"):
        runtime.operation("deep", input_schema=deep)


async def test_the_handler_gets_the_validated_model_and_a_misfit_is_422() -> None:
    runtime = AgentRuntime("search")
    seen: list[Query] = []

    @runtime.operation("query")
    async def query(payload: Query) -> Query:
        seen.append(payload)
        return payload

    answer = await runtime.dispatch(Inbound("query", {}, b'{"text": "durable"}'))
    assert answer.status == 200
    assert seen == [Query(text="durable")]
    assert answer.body == {"text": "durable", "top_k": 3}  # a model result is dumped
    bad = await runtime.dispatch(Inbound("query", {}, b'{"top_k": 0}'))
    assert bad.status == 422
    assert bad.body["error"]["type"] == "invalid_request"
    assert bad.body["error"]["message"].startswith("payload.text: Field required (and 1 more)")
    assert len(seen) == 1


def test_a_long_docstring_is_cut_to_what_the_registry_takes() -> None:
    runtime = AgentRuntime("wordy")

    def long(payload: dict) -> dict:  # type: ignore[type-arg]
        return {}

    long.__doc__ = "word " * 2000
    runtime.operation("long")(long)
    assert len(declared(runtime, "long")["description"]) == models.MAX_DESCRIPTION_CHARS


class Tree(BaseModel):
    label: str
    children: list[Tree] = []


class Opaque:
    pass


class Holder(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    thing: Opaque | None = None


def test_a_recursive_model_is_an_object_schema_and_an_unsayable_one_declares_nothing() -> None:
    runtime = AgentRuntime("trees")

    @runtime.operation("grow")  # a recursive model's root was a bare $ref: a ValueError
    async def grow(payload: Tree) -> dict[str, Any]:
        return {}

    @runtime.operation("hold")  # a field JSON Schema cannot say was a pydantic error
    async def hold(payload: Holder) -> dict[str, Any]:
        return {}

    schema = declared(runtime, "grow")["input_schema"]
    assert schema["type"] == "object"
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}
    assert "Tree" in schema["$defs"]
    models.OperationDeclaration(name="grow", input_schema=schema)  # Reach takes it at Join
    assert "hold" in runtime._dispatcher.join_operations()  # its name alone: any object
