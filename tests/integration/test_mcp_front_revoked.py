"""A caller's token revoked while its MCP front streams are open (`GET /mcp` and 2026-07-28's
`subscriptions/listen`): each stream ends within a recheck of the revocation, well before its
first keep-alive (the token was checked once, when the stream opened, and a revoked caller went
on hearing that its tools changed); the listen stream's last event is its request's error. A real
gateway with tokens required, on the real dev server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import GatewayProcess
from tests.integration.test_auth import bearer, issue_cli
from tests.integration.test_mcp_front_listen import LISTEN_HEADERS, listen_request

pytestmark = pytest.mark.integration

KEEPALIVE_S = 15.0  # the streams' keep-alive comment (docs/mcp-front.md)


async def held_until_it_ends(
    http: httpx.AsyncClient, method: str, url: str, opened: asyncio.Event, **kw: object
) -> tuple[float, list[str]]:
    """The stream's data lines after it opened, and when it ended (monotonic)."""
    lines: list[str] = []
    async with http.stream(method, url, **kw) as stream:  # type: ignore[arg-type]
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if not opened.is_set() and line:
                opened.set()  # its first frame: an acknowledgment or a comment
                continue
            if line.startswith("data:"):
                lines.append(line[5:])
    return time.monotonic(), lines


async def test_a_revoked_caller_s_streams_end_soon(temporal_server: str, tmp_path: Path) -> None:
    stack = new_stack(temporal_server, tmp_path)
    admin, _ = issue_cli(stack, "--principal", "ops", "--admin")
    caller, caller_id = issue_cli(stack, "--principal", "listener")
    async with GatewayProcess(stack, "mcp-revoked") as gateway:
        url = f"{gateway.url}/mcp"
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            got, heard = asyncio.Event(), asyncio.Event()
            get = asyncio.create_task(
                held_until_it_ends(
                    http,
                    "GET",
                    url,
                    got,
                    headers={**bearer(caller), "Accept": "text/event-stream"},
                )
            )
            listen = asyncio.create_task(
                held_until_it_ends(
                    http,
                    "POST",
                    url,
                    heard,
                    json=listen_request("sub-r", {"toolsListChanged": True}),
                    headers={**LISTEN_HEADERS, **bearer(caller)},
                )
            )
            async with asyncio.timeout(30):
                await asyncio.gather(got.wait(), heard.wait())
            d = await http.delete(
                f"{gateway.url}/reach/admin/tokens/{caller_id}", headers=bearer(admin)
            )
            assert d.status_code == 200, d.text
            revoked_at = time.monotonic()
            async with asyncio.timeout(KEEPALIVE_S * 2):
                (get_end, _), (listen_end, listened) = await asyncio.gather(get, listen)
            # Rechecked every 2 s: both end before the first keep-alive would have come.
            assert get_end - revoked_at < KEEPALIVE_S - 5, get_end - revoked_at
            assert listen_end - revoked_at < KEEPALIVE_S - 5, listen_end - revoked_at
            last = json.loads(listened[-1])
            assert last["id"] == "sub-r"
            assert last["error"]["code"] == -32000
            assert "revoked" in last["error"]["message"], last
            # The revoked token opens no new stream.
            again = await http.get(url, headers={**bearer(caller), "Accept": "text/event-stream"})
            assert again.status_code == 401
