"""What users import stays importable; connectors are found through their entry-point group."""

from __future__ import annotations

import pytest

import agent_reach_sdk
import connectors
from connectors.http import HttpConnector


def test_sdk_public_api() -> None:
    assert set(agent_reach_sdk.__all__) == {
        "AgentRuntime",
        "Deferred",
        "OperationError",
        "RequestContext",
        "current_request_id",
        "install_request_id_logging",
    }
    for name in agent_reach_sdk.__all__:
        assert getattr(agent_reach_sdk, name) is not None


def test_http_connector_is_registered_as_an_entry_point() -> None:
    assert connectors.available()["http"] == "connectors.http:HttpConnector"
    assert connectors.load("http") is HttpConnector


def test_unknown_protocol_fails_loudly_with_the_known_names() -> None:
    known = "a2a, grpc, http, mcp, mqtt, websocket"
    with pytest.raises(LookupError, match=rf"'smoke-signals'.*known: {known}"):
        connectors.load("smoke-signals")


def test_the_sdk_still_says_whether_start_workflow_started_the_workflow() -> None:
    """The gateway tells a repeat from a first request by the start response's `started` flag,
    which the Temporal SDK keeps on the handle as `_start_workflow_response`."""
    from temporalio.api.workflowservice.v1 import StartWorkflowExecutionResponse
    from temporalio.client import WorkflowHandle

    from gateway_api.temporal_adapter import started_here

    for started in (True, False):
        handle: WorkflowHandle[object, object] = WorkflowHandle(
            None,  # type: ignore[arg-type]
            "id",
            start_workflow_response=StartWorkflowExecutionResponse(started=started),
        )
        assert started_here(handle) is started
