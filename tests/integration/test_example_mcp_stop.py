"""The example MCP server stops on SIGTERM while a client holds its listening stream open: a
gateway that registered it keeps a `GET /mcp` stream open for the server's notifications, and
uvicorn's shutdown waited for that stream without end (the server was still up 20 s after
SIGTERM, and went only once the gateway stopped)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway_api.devserver import free_port, wait_port

ROOT = Path(__file__).resolve().parents[2]
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


MODERN = "2026-07-28"


def _listen(http: httpx.Client, url: str) -> httpx.Response:
    """A 2026-07-28 `subscriptions/listen` stream, as a gateway that registered the server holds."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "stop-test", "version": "1"},
    }
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "subscriptions/listen",
        "params": {"notifications": {"toolsListChanged": True}, "_meta": meta},
    }
    headers = {**HEADERS, "mcp-protocol-version": MODERN, "mcp-method": "subscriptions/listen"}
    request = http.build_request("POST", url, json=message, headers=headers)
    return http.send(request, stream=True)


def test_sigterm_stops_the_example_mcp_server_with_a_listening_stream_open() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "mcp_server.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, timeout_s=30)
        with httpx.Client(trust_env=False, timeout=60) as http:
            stream = _listen(http, url)
            try:
                assert stream.status_code == 200, stream.read()
                assert stream.headers["content-type"].startswith("text/event-stream")
                server.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                # It stops within its grace (3 s) and a margin for a loaded box, stream open.
                code = server.wait(timeout=30)
                took = time.monotonic() - sent
            finally:
                stream.close()
        assert code is not None
        assert took < 30, took
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
