"""What a front is: the small interface between a wire format and the door.

A front (the HTTP fast path `gateway_api.fast`, the documented route `routes/invoke.py`, the
gRPC front `gateway_api.grpc_front`; next the A2A and MCP fronts) does three things and no
more:

1. Reads its request's metadata into one mapping of lower-case names (HTTP's names:
   `authorization`, `x-reach-caller`, `traceparent`, `idempotency-key`; see
   `gateway_api.steps.identify`) and its body into the JSON bytes `POST /reach/invoke` takes.
2. Calls `Door.invoke(metadata, body, front)`: `body` is read only once the metadata passed
   (a refused token is refused before a large body is read; `Bytes` wraps one already read),
   and `front` is itself: the door tells it the request's id through `named` as soon as it
   has one.
3. Writes the envelope back in its own format, or the refusal: `ReachError` (its `type`
   decides the HTTP status, `reach.errors`) or Temporal's `RPCError`
   (`gateway_api.errors.reach_error_of_rpc`).

A front may also have `async def started(self, request_id) -> LetGo`: a synchronous request's
workflow is durable now (started, or the earlier run a repeat attaches to) and the door goes on
to wait for its verdict, or lets the request go first (`gateway_api.steps.wait.LetGo`): after
so many seconds (A2A's returnImmediately and an MCP task: 0; the MCP tasks extension: 1), or
once a future is done (the HTTP fronts: the client disconnected). A request let go is
answered `accepted` and accounted so (as one with a callback); the door then holds nothing of
it, neither a waiter nor room among the bytes in flight, and its result is read from its
workflow later (GetTask, tasks/get, GET /reach/requests/{id}).

Adding a front is one module (and its wiring in `gateway_api/app.py`); nothing in the door or
the steps changes. Identity, rules, limits, routing, the durable start, audit and metrics are
the door's.
"""

from __future__ import annotations

from typing import Protocol


class Body(Protocol):
    async def read(self) -> bytes: ...


class Bytes:
    """A body the front has already read (a gRPC message, say)."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


class Front(Protocol):
    async def named(self, request_id: str, caller: str) -> None:
        """The request has its RequestID (chosen by the caller or generated) and its caller:
        error envelopes name it from now on; a front that can tell its caller early does so
        here."""
        ...
