"""The dashboard at /ui in a real headless Chromium (Debian's package, driven by Playwright)
against real gateways and agent processes: it loads, asks for a token when tokens are required,
shows registered instances, reflects an eviction without a reload, lists a request and opens its
timeline, and shows agent-written strings as text, never as markup."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, start_agents

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("REACH_TEST_CHROMIUM", "/usr/bin/chromium")
TEMPORAL_UI = "http://127.0.0.1:18233"
WAIT_MS = 15_000  # eviction: heartbeat_timeout 3 s, the sweep, one poll (1.5 s)
SECONDS_AGO = re.compile(r"^\d+(\.\d)?s ago$")


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        message = f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    async with async_playwright() as p:
        # Playwright's own browser download cannot work here: Debian's chromium, headless.
        launched = await p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture(scope="module")
async def secured(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[GatewayProcess, str, str]]:
    """A gateway that requires tokens, with the Temporal UI at a configured address:
    (gateway, a caller token, an agent token for any capability)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    stack = new_stack(temporal_server, tmp, extra={"REACH_TEMPORAL__UI_URL": TEMPORAL_UI + "/"})
    store = FileTokenStore(tmp / "tokens.json")
    caller, record = issue("dashboard-viewer", "caller", [])
    store.write(record)
    agent, record = issue("dashboard-agents", "agent", ["*"])
    store.write(record)
    gw = await GatewayProcess(stack).ready()
    try:
        yield gw, caller, agent
    finally:
        gw.proc.stop()


async def open_dashboard(browser: Browser, gw: GatewayProcess) -> tuple[Page, list[str]]:
    """A fresh tab on /ui; the list collects script errors (there must be none)."""
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(WAIT_MS)
    await page.goto(f"{gw.url}/ui")
    return page, errors


async def give_token(page: Page, token: str) -> None:
    form = page.locator("#token-form")
    await expect(form).to_be_visible()
    await page.fill("#token-input", token)
    await page.click("#token-form button")


def instance_row(page: Page, instance_id: str) -> Any:
    return page.locator(f'tr[data-instance="{instance_id}"]')


async def test_the_page_asks_for_a_token_shows_the_instance_and_its_eviction(
    secured: tuple[GatewayProcess, str, str], browser: Browser, capability: str
) -> None:
    gw, caller, agent_token = secured
    agent = await Agent(
        gw, f"{capability}-01", capability, env={"REACH_AGENT_TOKEN": agent_token}
    ).ready()
    page, errors = await open_dashboard(browser, gw)

    # Tokens are required: the page asks once; a wrong token is refused and it asks again.
    await give_token(page, "reach_000000000000_" + "x" * 43)
    await expect(page.locator("#token-error")).to_have_text("the gateway refused this token")
    await give_token(page, caller)
    await expect(page.locator("#token-form")).to_be_hidden()
    assert await page.evaluate("sessionStorage.getItem('reach.token')") == caller

    row = instance_row(page, agent.instance_id)
    await expect(row).to_be_visible()
    cells = row.locator("td")
    await expect(cells.nth(1)).to_have_text("http")  # protocol
    await expect(cells.nth(2)).to_contain_text("127.0.0.1:")  # address
    await expect(cells.nth(3)).to_have_text("ok")  # health
    await expect(cells.nth(4)).to_have_text("corpus=6")  # the agent's self-check
    await expect(cells.nth(5)).to_have_text("0")  # in flight
    await expect(cells.nth(6)).to_have_text(SECONDS_AGO)  # last heartbeat
    await expect(page.locator("#conn")).to_contain_text("live")

    # No reload from here on: a mark on the window must survive.
    await page.evaluate("window.__sameDocument = true")
    agent.proc.kill()  # SIGKILL: no leave, the heartbeats just stop
    await expect(row).to_have_count(0)
    card = page.locator(f'[data-capability="{capability}"]')
    await expect(card).to_contain_text("no instances")
    assert await page.evaluate("window.__sameDocument") is True
    # The token is asked for once per tab, not again after the first.
    await expect(page.locator("#token-form")).to_be_hidden()
    assert errors == []
    await page.close()


async def test_a_request_links_to_its_timeline_and_its_temporal_page(
    secured: tuple[GatewayProcess, str, str], browser: Browser, capability: str
) -> None:
    gw, caller, agent_token = secured
    await Agent(gw, f"{capability}-01", capability, env={"REACH_AGENT_TOKEN": agent_token}).ready()
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(
            f"{gw.url}/reach/invoke",
            json={"target": capability, "operation": "query", "payload": {"text": "durable"}},
            headers={"Authorization": f"Bearer {caller}"},
        )
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]

    page, errors = await open_dashboard(browser, gw)
    await give_token(page, caller)
    row = page.locator(f'tr[data-request-id="{request_id}"]')
    await expect(row).to_be_visible()
    await expect(row.locator("td").nth(1)).to_have_text(f"{capability} · query")
    await expect(row.locator("td").nth(3)).to_have_text("success")
    await expect(row.locator("td").nth(6)).to_have_text(re.compile(r"^\d+ ms$"))
    temporal = f"{TEMPORAL_UI}/namespaces/default/workflows/{request_id}"
    await expect(row.locator("a.temporal-link")).to_have_attribute("href", temporal)

    await page.evaluate("window.__sameDocument = true")
    await row.locator("a.timeline-link").click()
    section = page.locator("#timeline-section")
    await expect(section).to_be_visible()
    await expect(page.locator("#timeline-id")).to_have_text(request_id)
    await expect(page.locator("#timeline-status")).to_have_text("success")
    events = page.locator("#timeline li.event")
    await expect(events.first).to_be_visible()
    assert await events.count() >= 2
    assert (await events.first.locator(".at").text_content() or "").startswith("+")
    await expect(page.locator("#timeline-temporal")).to_have_attribute("href", temporal)
    assert await page.evaluate("window.__sameDocument") is True
    assert page.url.endswith(f"/ui#timeline/{request_id}")

    await page.click("#timeline-close")
    await expect(section).to_be_hidden()
    assert errors == []
    await page.close()


async def test_agent_strings_are_text_never_markup(
    gateway: GatewayProcess, browser: Browser, http: httpx.AsyncClient, capability: str
) -> None:
    """An agent writes its own checks: markup in them must show as text and never run."""
    hostile = '<img src=x onerror="window.__pwned=1">'
    instance_id = f"{capability}-hostile"
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": capability,
            "instance_id": instance_id,
            "protocol": "http",
            "service_address": "127.0.0.1:9",
            "heartbeat_interval": 0.5,
            "labels": {"team": "x"},
        },
    )
    assert r.status_code == 200, r.text
    beat = {"status": "degraded", "checks": {"note": hostile, "<b>k</b>": "</td><script>"}}

    async def heartbeat() -> None:
        while True:
            await http.put(f"{gateway.url}/reach/agents/{instance_id}/heartbeat", json=beat)
            await asyncio.sleep(0.4)

    beating = asyncio.create_task(heartbeat())
    try:
        page, errors = await open_dashboard(browser, gateway)
        row = instance_row(page, instance_id)
        checks = row.locator("td").nth(4)
        await expect(checks).to_contain_text(hostile)
        await expect(checks).to_contain_text("<b>k</b>=</td><script>")
        await expect(row.locator("td").nth(3)).to_have_text("degraded")
        assert await row.locator("img, b, script").count() == 0
        await page.wait_for_timeout(500)
        assert await page.evaluate("window.__pwned") is None
        assert errors == []
        await page.close()
    finally:
        beating.cancel()
        await http.delete(f"{gateway.url}/reach/agents/{instance_id}")


async def test_screenshot_with_agents_and_requests(
    gateway: GatewayProcess, browser: Browser, capability: str, tmp_path: Path
) -> None:
    """Two agents and a few requests, as the README's picture shows them."""
    agents = await start_agents(gateway, capability, 2)
    request_ids = []
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        for operation, payload in [
            ("query", {"text": "durable retries", "top_k": 2}),
            ("get_metadata", {}),
            ("query", {"text": "heartbeats", "top_k": 1}),
            ("fail", {"status": 400}),
        ]:
            r = await client.post(
                f"{gateway.url}/reach/invoke",
                json={"target": capability, "operation": operation, "payload": payload},
            )
            request_ids.append(r.json()["request_id"])
    page, errors = await open_dashboard(browser, gateway)
    for agent in agents:
        await expect(instance_row(page, agent.instance_id)).to_be_visible()
    for request_id in request_ids:
        await expect(page.locator(f'tr[data-request-id="{request_id}"]')).to_be_visible()
    failed = page.locator(f'tr[data-request-id="{request_ids[-1]}"]')
    await expect(failed.locator("td").nth(3)).to_have_text("error")
    await page.locator(f'tr[data-request-id="{request_ids[0]}"] a.timeline-link').click()
    await expect(page.locator("#timeline li.event").first).to_be_visible()
    await page.wait_for_timeout(300)
    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)  # to look at
    assert errors == []
    await page.close()
