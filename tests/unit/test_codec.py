"""The process-wide payload converter (`activities.codec.PAYLOAD_CONVERTER`): pydantic's bytes,
one type-adapter cache for every workflow the process runs, and nothing kept from the sandbox's
per-run copies of a workflow's modules."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, WorkflowRunner

from activities.codec import PAYLOAD_CONVERTER
from reach.invocation import InvokeResponse
from reach.messages import ErrorInfo
from workflows.callback import DeliverCallbackWorkflow
from workflows.invoke import InvokeWorkflow

HISTORY = Path(__file__).parent.parent / "histories" / "success.json"


def _json(converter: DataConverter) -> Any:
    """The JSON converter inside a data converter's payload converter."""
    inner = converter.payload_converter
    inner = getattr(inner, "_inner_payload_converter", inner)  # the SDK's transfer-type wrapper
    return inner.converters[b"json/plain"]


VALUES: list[Any] = [
    InvokeResponse(
        request_id="req-1",
        status="error",
        duration_ms=3,
        error=ErrorInfo(type="timeout", message="late", retryable=False),
    ),
    {"text": "durable", "none": None, "nested": {"n": [1, 2.5, None]}},
    ["a", 1, None],
    None,
    b"\x00raw",
]


@pytest.mark.parametrize("value", VALUES, ids=["model", "dict", "list", "none", "bytes"])
def test_it_writes_the_bytes_pydantics_converter_writes(value: Any) -> None:
    # Histories written before (and the codec server, `temporal workflow show`) read the same.
    ours = PAYLOAD_CONVERTER.payload_converter.to_payloads([value])
    stock = pydantic_data_converter.payload_converter.to_payloads([value])
    assert ours == stock
    [back] = PAYLOAD_CONVERTER.payload_converter.from_payloads(ours, [type(value)])
    assert back == value


def test_every_converter_the_sdk_builds_shares_one_type_adapter_cache() -> None:
    # The SDK builds a data converter (and so a payload converter) for every workflow it runs.
    first, second = dataclasses.replace(PAYLOAD_CONVERTER), dataclasses.replace(PAYLOAD_CONVERTER)
    assert first.payload_converter is not second.payload_converter
    assert _json(first) is _json(second)
    cache = _json(first)._type_adapter
    cache.cache_clear()
    [payload] = first.payload_converter.to_payloads([ErrorInfo(type="internal", message="m")])
    for converter in (first, second, first):
        converter.payload_converter.from_payloads([payload], [ErrorInfo])
    assert (cache.cache_info().misses, cache.cache_info().hits) == (1, 2)
    # Pydantic's own builds a cache per instance: what the shared one saves.
    stock = dataclasses.replace(pydantic_data_converter)
    assert _json(stock) is not _json(pydantic_data_converter)


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])
async def test_workflow_runs_reuse_the_cache_and_the_sandbox_adds_nothing_to_it(
    sandboxed: bool,
) -> None:
    runner: dict[str, WorkflowRunner] = (
        {} if sandboxed else {"workflow_runner": UnsandboxedWorkflowRunner()}
    )
    replayer = Replayer(
        workflows=[InvokeWorkflow, DeliverCallbackWorkflow],
        data_converter=PAYLOAD_CONVERTER,
        **runner,  # type: ignore[arg-type]
    )
    history = WorkflowHistory.from_json("codec-success", HISTORY.read_text())
    cache = _json(PAYLOAD_CONVERTER)._type_adapter
    cache.cache_clear()
    sizes = []
    for _ in range(3):
        result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
        assert result.replay_failure is None
        sizes.append(cache.cache_info().currsize)
    info = cache.cache_info()
    if sandboxed:
        # Inside the sandbox nothing is cached: a workflow module that is not passed through is
        # imported afresh for every run, and its classes would each keep an entry alive.
        assert sizes == [0, 0, 0]
    else:
        # The types the invoke workflow decodes, built once, then found by every later run.
        assert sizes[0] > 0
        assert sizes == [sizes[0]] * 3
        assert info.hits == 2 * info.misses
