"""Whose request it is, and whose token invokes (issue 25): a caller cannot read or attach to
another caller's request by its RequestID (404 as if unknown, 409 that says only "taken", both
audited), an agent token does not invoke, and an admin token does, as its principal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, rid, wait_until
from tests.integration.test_auth import audit_lines, bearer, body, start_agent

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def door(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[GatewayProcess, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("scoping")
    stack = new_stack(temporal_server, tmp)
    store = FileTokenStore(tmp / "tokens.json")
    tokens: dict[str, str] = {}
    for name, kind, caps in [
        ("alice", "caller", []),
        ("bob", "caller", []),
        ("ops", "admin", []),
        ("kr", "agent", ["*"]),
    ]:
        token, record = issue(name, kind, caps)  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    async with GatewayProcess(stack, "scoping") as gateway:
        yield gateway, tokens


async def test_another_callers_request_id_is_neither_readable_nor_attachable(
    door: tuple[GatewayProcess, dict[str, str]], http: httpx.AsyncClient, capability: str
) -> None:
    gateway, tokens = door
    await start_agent(gateway, capability, tokens["kr"])
    invoke, taken = f"{gateway.url}/reach/invoke", rid()
    first = await http.post(
        invoke, json=body(capability, request_id=taken), headers=bearer(tokens["alice"])
    )
    assert first.status_code == 200, first.text

    # Reading it: as if it did not exist (the same answer as an id nobody used).
    unused = rid()
    never = await http.get(f"{gateway.url}/reach/requests/{unused}", headers=bearer(tokens["bob"]))
    peek = await http.get(f"{gateway.url}/reach/requests/{taken}", headers=bearer(tokens["bob"]))
    assert (peek.status_code, never.status_code) == (404, 404)
    assert peek.json()["error"] == {
        **never.json()["error"],
        "message": never.json()["error"]["message"].replace(unused, taken),
    }
    # Attaching to it with the very same body: refused, saying nothing of the request.
    attach = await http.post(
        invoke, json=body(capability, request_id=taken), headers=bearer(tokens["bob"])
    )
    assert attach.status_code == 409, attach.text
    error = attach.json()["error"]
    assert error["type"] == "request_conflict"
    assert "taken" in error["message"]
    assert "alice" not in attach.text
    assert "result" not in attach.json()
    # Its caller still attaches to it; an admin reads it.
    again = await http.post(
        invoke, json=body(capability, request_id=taken), headers=bearer(tokens["alice"])
    )
    assert again.status_code == 200, again.text
    assert again.json()["result"] == first.json()["result"]
    admin = await http.get(f"{gateway.url}/reach/requests/{taken}", headers=bearer(tokens["ops"]))
    assert admin.status_code == 200, admin.text

    def tries() -> set[str]:
        wanted = {"request_read_refused", "request_id_taken"}
        return {
            a["event"]
            for a in audit_lines(gateway.stack)
            if a["event"] in wanted and a["request_id"] == taken
        }

    await wait_until(lambda: tries() == {"request_read_refused", "request_id_taken"}, 10)
    invokes = [
        a for a in audit_lines(gateway.stack) if a["event"] == "invoke" and a["request_id"] == taken
    ]
    assert {a["caller"] for a in invokes} == {"alice"}  # bob's try is not its outcome


async def test_an_agent_token_does_not_invoke_and_an_admin_token_does(
    door: tuple[GatewayProcess, dict[str, str]], http: httpx.AsyncClient, capability: str
) -> None:
    gateway, tokens = door
    await start_agent(gateway, capability, tokens["kr"])
    invoke = f"{gateway.url}/reach/invoke"
    r = await http.post(invoke, json=body(capability), headers=bearer(tokens["kr"]))
    assert r.status_code == 403, r.text
    assert "agent token" in r.json()["error"]["message"]
    r = await http.post(invoke, json=body(capability), headers=bearer(tokens["ops"]))
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]

    def audited() -> dict[str, Any]:
        return {
            a["event"]: a
            for a in audit_lines(gateway.stack)
            if (a["event"] == "refused" and "agent token" in str(a.get("reason")))
            or (a["event"] == "invoke" and a["request_id"] == request_id)
        }

    await wait_until(lambda: audited().keys() == {"refused", "invoke"}, 10)
    assert audited()["invoke"]["caller"] == "ops"
