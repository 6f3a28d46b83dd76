"""`reach invoke --idempotency-key K` that times out no longer says "to wait longer:
--timeout-ms MS" (issue 25): the key keeps the timeout, so the same key with a longer
--timeout-ms replays it. The hint says a new key is needed, and only once the trace shows it
did not run. Real gateway, real agent, the real CLI."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import GatewayProcess, start_agents
from tests.integration.test_cli_view import reach

pytestmark = pytest.mark.integration


async def test_a_keyed_timeout_says_a_longer_wait_needs_a_new_key(gateway: GatewayProcess) -> None:
    capability = f"cli-keyed-{uuid.uuid4().hex[:8]}"
    slow = await start_agents(gateway, capability, 1, "--delay-ms", "3000")
    key = f"kk-{uuid.uuid4().hex[:8]}"
    try:
        done = reach(
            "invoke", capability, "create", "--payload", '{"note": "x"}', "--timeout-ms", "300",
            "--idempotency-key", key, "--gateway", gateway.url,
        )  # fmt: skip
    finally:
        for agent in slow:
            agent.proc.stop()
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("timeout "), done.stderr
    assert "to wait longer: --timeout-ms MS" not in done.stderr, done.stderr
    assert "a longer --timeout-ms needs a new --idempotency-key" in done.stderr, done.stderr
    assert "only once the trace shows it did not run" in done.stderr, done.stderr
    assert "it may have run: look (reach trace " in done.stderr, done.stderr
