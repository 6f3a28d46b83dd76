"""`logging/setLevel` at the MCP front (`gateway_api._mcp_logging`): a session's level is kept
in the policy state under the session's digest for a day, and session ids are minted by anyone
(any random part after the caller's own digest), so each setLevel was one more key however
many a caller sent. A caller's kept levels are now bounded by a bucket, another caller's not
touched by it."""

from __future__ import annotations

import pytest

from gateway_api.mcp_front import logs, wire
from reach.policy.state import MemoryPolicyState


def minted(caller: str, n: int) -> str:
    return wire.new_session("2025-11-25", caller)[:-16] + f"{n:016x}"


async def test_a_callers_set_levels_are_bounded_and_anothers_are_not() -> None:
    now = [1000.0]
    state = MemoryPolicyState(clock=lambda: now[0])
    burst = int(logs.SET_LEVEL_PER_MINUTE)
    for n in range(burst):
        session = minted("alice", n)
        assert wire.session_version(session, "alice") == "2025-11-25"
        await logs.set_level(state, session, {"level": "warning"}, "alice")
        assert await logs.session_level(state, session) == "warning"
    with pytest.raises(wire.RpcError) as refused:
        await logs.set_level(state, minted("alice", burst), {"level": "error"}, "alice")
    assert refused.value.code == wire.REACH_REFUSED
    assert refused.value.data is not None
    assert refused.value.data["type"] == "rate_limited"
    assert refused.value.data["retry_after_s"] >= 1
    assert await logs.session_level(state, minted("alice", burst)) is None
    await logs.set_level(state, minted("bob", 0), {"level": "error"}, "bob")  # not alice's bucket
    assert await logs.session_level(state, minted("bob", 0)) == "error"
    now[0] += 60 / logs.SET_LEVEL_PER_MINUTE  # a token back
    await logs.set_level(state, minted("alice", burst), {"level": "error"}, "alice")
    assert await logs.session_level(state, minted("alice", burst)) == "error"


async def test_a_set_level_without_a_session_keeps_nothing_and_takes_nothing() -> None:
    state = MemoryPolicyState()
    for _ in range(3 * int(logs.SET_LEVEL_PER_MINUTE)):
        await logs.set_level(state, None, {"level": "debug"}, "alice")
    with pytest.raises(wire.RpcError) as bad:
        await logs.set_level(state, minted("alice", 1), {"level": "loud"}, "alice")
    assert bad.value.code == wire.INVALID_PARAMS
