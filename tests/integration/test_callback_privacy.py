"""What a callback delivery shows of itself (issue 25): never the URL's credentials or query,
and, with encryption on, the receiver's refusal in words rather than "Encoded failure"."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from reach.security.crypto import new_key
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, invoke, start_agents, wait_until
from tests.integration.test_encrypted_history import admin_token, encryption_env

pytestmark = pytest.mark.integration


async def test_a_pending_delivery_shows_its_error_and_hides_the_urls_secrets(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    _, auth = admin_token(tmp_path)
    stack = new_stack(
        temporal_server, tmp_path, extra={**encryption_env("k1", {"k1": new_key()}), **auth}
    )
    async with (
        CallbackReceiver(fail_first=10_000, fail_status=503) as receiver,
        GatewayProcess(stack, "private") as gateway,
    ):
        await start_agents(gateway, capability, 1)
        secret_url = receiver.url.replace("http://", "http://user:hunter2@") + "?sig=s3cr3t"
        r = await invoke(http, gateway, capability, callback=secret_url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]

        async def retrying() -> bool:
            read = await http.get(f"{gateway.url}/reach/requests/{request_id}")
            delivery = read.json().get("delivery") or {}
            return delivery.get("status") == "pending" and bool(delivery.get("last_error"))

        await wait_until(retrying, 30)
        read = await http.get(f"{gateway.url}/reach/requests/{request_id}")
        delivery = read.json()["delivery"]
        assert "Encoded failure" not in delivery["last_error"]
        assert "503" in delivery["last_error"], delivery
        shown = json.dumps(read.json())
        assert "hunter2" not in shown
        assert "s3cr3t" not in shown
        assert delivery["url"].startswith(receiver.url)
        assert "hunter2" not in gateway.proc.output()  # nor in the gateway's log lines
