"""The floors' one activity: the HTTP call to the agent that Reach's HTTP connector makes, with
httpx as the connector does; and the floor's start. Shared by the bench process and
`bench/raw_front.py`."""

from __future__ import annotations

import uuid

import httpx
from temporalio import activity
from temporalio.client import Client
from temporalio.common import (
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)

from bench.raw_workflow import RawWorkflow

PAYLOAD = {"text": "durable retries", "top_k": 2}
_http: httpx.AsyncClient | None = None


def open_client() -> httpx.AsyncClient:
    """The activity's client (keep-alive, as many connections as the bench keeps in flight)."""
    global _http
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    _http = httpx.AsyncClient(trust_env=False, limits=limits, timeout=30)
    return _http


@activity.defn(name="call_agent")
async def call_agent(url: str) -> dict[str, object]:
    assert _http is not None, "open_client() first"
    r = await _http.post(url, json=PAYLOAD, headers={"X-Reach-Request-Id": str(uuid.uuid4())})
    result: dict[str, object] = r.json()
    return result


async def run_floor(
    client: Client,
    url: str,
    task_queue: str,
    *,
    summary: str | None = None,
    attributes: TypedSearchAttributes | None = None,
) -> dict[str, object]:
    """The floor: eager start of RawWorkflow (a new id, as Reach's), its result."""
    result: dict[str, object] = await client.execute_workflow(
        RawWorkflow.run,
        url,
        id=str(uuid.uuid4()),
        task_queue=task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        request_eager_start=True,
        static_summary=summary,
        search_attributes=attributes,
    )
    return result
