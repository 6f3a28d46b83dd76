"""A web page may not drive a gateway that requires no tokens (gateway_api/browsers.py): a
cross-site POST the browser sends unasked (text/plain) and a DNS-rebound page (its own name as
the Host) are refused 403 on every route, the A2A front's included; programs, which send no
Origin, and the gateway's own pages are served as before."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import GatewayProcess

pytestmark = pytest.mark.integration

INVOKE = b'{"target": "nowhere", "operation": "x", "payload": {}}'
SEND = b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {}}'


async def test_pages_elsewhere_are_refused_programs_and_its_own_pages_served(
    temporal_server: str, tmp_path: Path
) -> None:
    stack = new_stack(temporal_server, tmp_path)
    async with (
        GatewayProcess(stack, worker=False) as gateway,
        httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=20) as http,
    ):
        page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        rebound = {**page, "Host": "evil.example"}
        for headers in (page, rebound):
            for path, body in (("/reach/invoke", INVOKE), ("/a2a/nowhere", SEND)):
                r = await http.post(path, content=body, headers=headers)
                assert r.status_code == 403, (path, headers, r.text)
                assert r.json()["error"]["type"] == "forbidden"
        for path in ("/reach/capabilities", "/ui", "/reach/requests/req-1"):
            assert (await http.get(path, headers={"Host": "evil.example"})).status_code == 403
        # A program (no Origin), and the dashboard's own origin, are served as before.
        r = await http.post("/reach/invoke", content=INVOKE)
        assert r.json()["error"]["type"] == "unknown_capability", r.text
        own = {"Origin": gateway.url, "Content-Type": "application/json"}
        r = await http.post("/reach/invoke", content=INVOKE, headers=own)
        assert r.json()["error"]["type"] == "unknown_capability", r.text
        assert (await http.get("/ui", headers={"Host": "localhost"})).status_code == 200
        slashed = await http.get("/ui/", headers={"Host": "localhost"})  # typed by hand
        assert (slashed.status_code, slashed.headers.get("location")) == (308, "/ui")
