"""Signed callbacks end to end: a real gateway with `security.webhook_key`, a real agent, and a
loopback receiver that verifies each delivery with the Standard Webhooks reference library."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from agent_reach_sdk.wire import Answer, Inbound
from reach.security.webhooks import caller_secret
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, invoke, rid, start_agents

pytestmark = pytest.mark.integration

MASTER = f"test-master-{uuid.uuid4().hex}"
CALLER = "orchestrator"


class RawReceiver(CallbackReceiver):
    """Records every attempt, refused ones too, with the body exactly as it arrived."""

    def __init__(self, *, fail_first: int = 0) -> None:
        super().__init__(fail_first=fail_first)
        self.attempts: list[tuple[dict[str, str], bytes]] = []

    async def _handle(self, request: Inbound) -> Answer:
        self.attempts.append((dict(request.headers), request.body))
        return await super()._handle(request)


@pytest.fixture(scope="module")
async def signing_gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("signing"),
        extra={"REACH_SECURITY__WEBHOOK_KEY": MASTER},
    )
    async with GatewayProcess(stack, "signing") as gw:
        yield gw


async def invoke_with_callback(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, url: str
) -> str:
    """Start a call that answers to `url`; return its request id."""
    request_id = rid()
    r = await invoke(
        http,
        gateway,
        capability,
        request_id=request_id,
        payload={"text": "signed", "top_k": 1},
        callback=url,
        caller=CALLER,
    )
    assert r.status_code == 202, r.text
    return request_id


async def test_a_callback_verifies_with_the_callers_secret(
    signing_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(signing_gateway, capability, 1)
    receiver = RawReceiver()
    async with receiver:
        request_id = await invoke_with_callback(http, signing_gateway, capability, receiver.url)
        await receiver.wait(1)
        assert len(receiver.attempts) == 1
        headers, raw = receiver.attempts[0]
        assert headers["webhook-id"] == f"msg_{request_id}"
        envelope = Webhook(caller_secret(MASTER, CALLER)).verify(raw, headers)
        assert envelope["request_id"] == request_id
        assert envelope["status"] == "success"
        # Another caller's secret (or another master key) does not verify it.
        for secret in (caller_secret(MASTER, "someone-else"), caller_secret("other", CALLER)):
            with pytest.raises(WebhookVerificationError):
                Webhook(secret).verify(raw, headers)


async def test_a_redelivery_keeps_the_webhook_id(
    signing_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(signing_gateway, capability, 1)
    receiver = RawReceiver(fail_first=1)
    async with receiver:
        request_id = await invoke_with_callback(http, signing_gateway, capability, receiver.url)
        await receiver.wait(1)
        assert receiver.refused == 1
        assert len(receiver.attempts) == 2
        verifier = Webhook(caller_secret(MASTER, CALLER))
        for headers, raw in receiver.attempts:
            assert headers["webhook-id"] == f"msg_{request_id}"
            assert verifier.verify(raw, headers)["request_id"] == request_id
        assert [h["x-reach-delivery-attempt"] for h, _ in receiver.attempts] == ["1", "2"]
