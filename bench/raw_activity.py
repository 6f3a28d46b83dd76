"""The floors' one activity: the HTTP call to the agent that Reach's HTTP connector makes, with
httpx as the connector does. Shared by the bench process and `bench/raw_front.py`."""

from __future__ import annotations

import uuid

import httpx
from temporalio import activity

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
