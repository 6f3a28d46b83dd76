"""Questions an MCP server asks mid-call, relayed through the shared policy state
(`reach.asks`: the call's side; the MCP front's, `gateway_api._mcp_ask`): the whole round in
one memory store, and each refusal — no stream offered, a capability not declared, past the
call's bound, another caller's answer, an unknown id, an answer too large or given twice, the
stream gone while the question waits."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from connectors.mcp import McpServer
from gateway_api.mcp_front import ask, http, wire
from reach import asks
from reach.policy.state import MemoryPolicyState

SAMPLE = "sampling/createMessage"
ANSWER = {"role": "assistant", "content": {"type": "text", "text": "hi"}, "model": "m"}


class Sent:
    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    async def __call__(self, event: dict[str, Any]) -> None:
        for line in event["body"].decode().splitlines():
            if line.startswith("data: "):
                self.frames.append(json.loads(line[6:]))


def response(key: Any, **tail: Any) -> wire.Message:
    return wire.parse(json.dumps({"jsonrpc": "2.0", "id": key, **tail}).encode())


async def relayed(offer: ask.Offer, sent: Sent) -> dict[str, Any]:
    async with asyncio.timeout(5):
        while not sent.frames:
            await offer.forward(sent)  # type: ignore[arg-type]
            await asyncio.sleep(0.01)
    return sent.frames.pop(0)


def questions(state: MemoryPolicyState, rid: str = "r-1", caller: str = "alice") -> asks.Questions:
    return asks.Questions(state, rid, caller, 1, time.time() + 30)


async def test_a_question_goes_to_the_callers_stream_and_its_answer_back() -> None:
    state = MemoryPolicyState()
    offer = ask.Offer(state, "se")
    await offer.claim("r-1", "alice")
    assert offer.open
    asking = asyncio.create_task(questions(state).ask(SAMPLE, {"maxTokens": 5}, 4096))
    sent = Sent()
    request = await relayed(offer, sent)
    assert request["method"] == SAMPLE
    assert request["params"] == {"maxTokens": 5}
    key = request["id"]
    assert key.startswith(asks.ASK_ID_PREFIX)
    with pytest.raises(http.Answer) as bobs:
        await ask.answer(state, response(key, result=ANSWER), "bob")
    assert bobs.value.status == 403
    with pytest.raises(http.Answer) as unknown:
        await ask.answer(state, response("reach-ask-" + "0" * 32, result=ANSWER), "alice")
    assert unknown.value.status == 404
    with pytest.raises(http.Answer) as malformed:
        await ask.answer(state, response(key, result=[1]), "alice")
    assert malformed.value.status == 400
    await ask.answer(state, response(key, result=ANSWER), "alice")
    assert await asyncio.wait_for(asking, 5) == {"result": ANSWER}
    with pytest.raises(http.Answer) as twice:
        await ask.answer(state, response(key, error={"code": -1, "message": "no"}), "alice")
    assert twice.value.status == 409
    await offer.close()
    assert await state.peek(asks.offer_key("r-1")) is None


async def test_an_error_the_client_answers_is_what_the_agent_gets() -> None:
    state = MemoryPolicyState()
    offer = ask.Offer(state, "s")
    await offer.claim("r-1", "alice")
    asking = asyncio.create_task(questions(state).ask(SAMPLE, {}, 4096))
    key = (await relayed(offer, Sent()))["id"]
    await ask.answer(state, response(key, error={"code": -1, "message": "user said no"}), "alice")
    assert await asyncio.wait_for(asking, 5) == {"error": {"code": -1, "message": "user said no"}}


async def test_what_cannot_be_relayed_is_refused_at_once() -> None:
    state = MemoryPolicyState()
    said = await asyncio.wait_for(questions(state).ask(SAMPLE, {}, 4096), 1)
    assert said["error"]["code"] == -32601
    assert "no client that can answer waits on this call" in said["error"]["message"]
    offer = ask.Offer(state, "s")  # sampling only
    await offer.claim("r-1", "alice")
    said = await asyncio.wait_for(questions(state).ask("elicitation/create", {}, 4096), 1)
    assert "did not declare that capability" in said["error"]["message"]
    said = await asyncio.wait_for(questions(state, caller="bob").ask(SAMPLE, {}, 4096), 1)
    assert "another caller's" in said["error"]["message"]
    big = {"text": "x" * 5000}
    said = await asyncio.wait_for(questions(state).ask(SAMPLE, big, 4096), 1)
    assert "larger than 4096 bytes" in said["error"]["message"]
    flooded = questions(state)
    flooded.asked = asks.MAX_ASKS_PER_CALL
    said = await asyncio.wait_for(flooded.ask(SAMPLE, {}, 4096), 1)
    assert f"at most {asks.MAX_ASKS_PER_CALL} questions" in said["error"]["message"]


async def test_one_stream_of_a_request_relays() -> None:
    state = MemoryPolicyState()
    first, second = ask.Offer(state, "s"), ask.Offer(state, "s")
    await first.claim("r-1", "alice")
    await second.claim("r-1", "alice")  # a repeat of the request, attached
    assert first.open
    assert not second.open


async def test_an_answer_over_its_bound_is_refused() -> None:
    state = MemoryPolicyState()
    offer = ask.Offer(state, "s")
    await offer.claim("r-1", "alice")
    asking = asyncio.create_task(questions(state).ask(SAMPLE, {}, 300))
    key = (await relayed(offer, Sent()))["id"]
    huge = {**ANSWER, "content": {"type": "text", "text": "y" * 400}}
    with pytest.raises(http.Answer) as refused:
        await ask.answer(state, response(key, result=huge), "alice")
    assert refused.value.status == 413
    asking.cancel()


async def test_a_question_whose_stream_closed_is_given_up() -> None:
    state = MemoryPolicyState()
    offer = ask.Offer(state, "s")
    await offer.claim("r-1", "alice")
    asking = asyncio.create_task(questions(state).ask(SAMPLE, {}, 4096))
    await relayed(offer, Sent())
    await offer.close()
    said = await asyncio.wait_for(asking, asks.OFFER_CHECK_S + 3)
    assert "stream closed" in said["error"]["message"]
    assert said["error"]["message"].startswith("Agent-Reach relayed")  # relayed, not answered


async def test_a_call_that_ends_gives_its_questions_up() -> None:
    state = MemoryPolicyState()
    offer = ask.Offer(state, "s")
    await offer.claim("r-1", "alice")
    call = questions(state)
    asking = asyncio.create_task(call.ask(SAMPLE, {}, 4096))
    await relayed(offer, Sent())
    call.close()
    said = await asyncio.wait_for(asking, 2)
    assert "call ended" in said["error"]["message"]


def test_what_a_client_declares_and_its_session_carries() -> None:
    assert asks.declared({"sampling": {}, "elicitation": {}}) == "se"
    assert asks.declared({"elicitation": {"url": {}}}) == "u"
    assert asks.declared({"elicitation": {"form": {}, "url": {}}}) == "eu"
    assert asks.declared({"roots": {}}) == ""
    session = wire.new_session("2025-11-25", "alice", "se")
    assert wire.session_version(session, "alice") == "2025-11-25"
    assert wire.session_caps(session, "alice") == "se"
    assert wire.session_caps(session, "bob") == ""
    plain = wire.new_session("2025-11-25", "alice")
    assert wire.session_caps(plain, "alice") == ""
    assert wire.session_version(plain + ".zz", "alice") is None


async def test_an_answer_after_its_question_was_given_up_is_refused() -> None:
    """The stream closed, the question given up: the answer that comes later is refused
    (404: nobody waits for it), not taken as if it had reached the agent."""
    state = MemoryPolicyState()
    offer = ask.Offer(state, "s")
    await offer.claim("r-1", "alice")
    asking = asyncio.create_task(questions(state).ask(SAMPLE, {}, 4096))
    key = (await relayed(offer, Sent()))["id"]
    await offer.close()
    said = await asyncio.wait_for(asking, asks.OFFER_CHECK_S + 3)
    assert "stream closed" in said["error"]["message"]
    assert said["error"]["message"].startswith("Agent-Reach relayed")  # relayed, not answered
    with pytest.raises(http.Answer) as late:
        await ask.answer(state, response(key, result=ANSWER), "alice")
    assert late.value.status == 404


async def test_questions_waiting_on_slow_callers_never_silence_another_callers() -> None:
    """Alice's calls hold 80 questions she does not answer (5 calls of 16, up to their
    deadlines); a question of bob's call, which cannot be relayed, is still refused at once (a
    real socket server hears the refusal), not left unanswered until his call's deadline."""
    heard: list[dict[str, Any]] = []
    bob_heard = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        heard.append(json.loads(await reader.readexactly(length)))
        if heard[-1].get("id") == "bob-1":
            bob_heard.set()
        writer.write(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    listening = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    state = MemoryPolicyState()
    async with listening, httpx.AsyncClient(trust_env=False) as client:
        server = McpServer(f"http://127.0.0.1:{port}/mcp", client, 4)
        held = []
        for call in range(5):
            rid = f"alice-{call}"
            offer = ask.Offer(state, "s")
            await offer.claim(rid, "alice")
            held.append(questions(state, rid))
            token = asks.QUESTIONS.set(held[-1])
            try:
                for n in range(16):
                    asked = {"jsonrpc": "2.0", "id": f"{rid}-{n}", "method": SAMPLE, "params": {}}
                    server._answer_later(None, asked, 4096)
            finally:
                asks.QUESTIONS.reset(token)
        await asyncio.sleep(0)  # the relays run, and wait
        bobs = {"jsonrpc": "2.0", "id": "bob-1", "method": SAMPLE, "params": {}}
        server._answer_later(None, bobs, 4096)  # no QUESTIONS: not through the front
        await asyncio.wait_for(bob_heard.wait(), 5)
        [refused] = [said for said in heard if said.get("id") == "bob-1"]
        assert refused["error"]["code"] == asks.METHOD_NOT_FOUND
        for call in held:
            call.close()


class HeldFirstQuestion(MemoryPolicyState):
    """A store whose first question write waits until let go (a slow Redis round trip)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.held = False

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        if key.startswith("mcp-ask:") and not self.held:
            self.held = True
            await self.go.wait()
        await super().put(key, value, ttl_s)


async def test_two_questions_at_once_both_reach_the_stream_whatever_the_store_order() -> None:
    """One call asking twice at once: the second's writes may not overtake the first's, or the
    front, reading the index at 2 while question 1 is not yet stored, skips it for good."""
    state = HeldFirstQuestion()
    offer = ask.Offer(state, "se")
    await offer.claim("r-1", "alice")
    q = questions(state)
    first = asyncio.create_task(q.ask(SAMPLE, {"maxTokens": 1}, 4096))
    second = asyncio.create_task(q.ask(SAMPLE, {"maxTokens": 2}, 4096))
    sent = Sent()
    for _ in range(20):  # the front looks while question 1's write is held
        await offer.forward(sent)  # type: ignore[arg-type]
        await asyncio.sleep(0.005)
    state.go.set()
    got = [await relayed(offer, sent), await relayed(offer, sent)]
    assert sorted(r["params"]["maxTokens"] for r in got) == [1, 2]
    for request in got:
        await ask.answer(state, response(request["id"], result=ANSWER), "alice")
    assert (await first)["result"] == ANSWER
    assert (await second)["result"] == ANSWER
