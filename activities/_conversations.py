"""Whose an agent's task is: a follow-up that continues another caller's task is not sent.

An A2A agent that answers with a task (still working, or asking for input) gives its ids to the
caller, who continues it with a later invoke naming them (`Connector.continues`). The agent
cannot tell Reach's callers apart (they all arrive as Reach), so Reach keeps who each task and
context belongs to, in the policy state every gateway shares, and refuses a follow-up from
anyone else before it is sent: 403, nothing reaches the agent.

Every answer naming the agent's ids counts, a task completed at once and a message answered
in a context too (`Reply.named`): else a context whose tasks all completed was nobody's, and a
stranger naming it appended to the conversation.

Costs one store round trip for an answer that hands out such ids (`Connector.conversations`)
and one per follow-up; nothing for any other call.
"""

from __future__ import annotations

import logging

from activities._sent import NotSent
from connectors.base import Connector
from reach.errors import Forbidden, ReachError
from reach.messages import Message, Reply
from reach.policy.state import PolicyState

log = logging.getLogger("reach.worker")

KEPT_S = 7 * 24 * 3600.0
"""How long a task's (or context's) caller is kept after the answer that named it."""


def owner_key(capability: str, conversation: str) -> str:
    return f"conv:{capability}:{conversation}"


async def check_follow_up(
    state: PolicyState, connector: Connector, capability: str, message: Message
) -> None:
    """Raise `NotSent` (403 `Forbidden`) when `message` continues a task or context another
    caller holds. An id nobody holds (never handed out, or kept past `KEPT_S`) becomes the
    caller's. A store that cannot answer refuses it too (`NotSent`, unavailable): nothing is
    sent unchecked."""
    caller = message.header.caller
    for conversation in connector.continues(message):
        try:
            held = await state.claim(owner_key(capability, conversation), caller, KEPT_S)
        except ReachError as err:
            raise NotSent(err) from err
        if held != caller:
            raise NotSent(
                Forbidden(
                    f"{conversation[:100]!r} is another caller's task on {capability!r}: a "
                    "follow-up continues only the caller's own"
                )
            )


async def keep_owner(
    state: PolicyState, connector: Connector, capability: str, caller: str, reply: Reply
) -> None:
    """Note `caller` as the holder of the tasks and contexts `reply` hands out. A store that
    cannot answer costs only that note (the answer is the caller's either way): logged."""
    for conversation in connector.conversations(reply):
        try:
            await state.claim(owner_key(capability, conversation), caller, KEPT_S)
        except ReachError as err:
            log.warning("could not note %s's task %r: %s", caller, conversation[:100], err)
