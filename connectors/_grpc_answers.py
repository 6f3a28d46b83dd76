"""What a gRPC call's outcome means: an OK reply's bytes become a `Reply` (`reply_of`), a failure
a Reach error (`error_for_status`: with `x-reach-status` through the table every protocol shares,
`connectors._answers`, without it through `STATUS_TABLE`), and grpcio's exceptions are mapped in
one place (`map_grpc_exceptions`). The contract they read is docs/protocols/grpc.md.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Literal

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from agent_reach_proto.agent_pb2 import InvokeReply
from agent_reach_proto.wire import GRPC_ERROR_TYPE, GRPC_RETRYABLE, GRPC_STATUS
from connectors._answers import reply_for_status, too_large
from reach.acceptance import check_json, parse_json
from reach.errors import (
    AgentError,
    AgentFault,
    DeadlineExceeded,
    InternalError,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Reply, dumps

_TOO_BIG = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")
# How grpc core words a call that never left: no connection was made (refused, unresolvable,
# nothing to dial). Any other transport failure came after the call was written to a
# connection, so the agent may have run it (`outcome_unknown`).
_NOT_SENT = re.compile(
    r"(?i)failed to connect|connection refused|dns resolution failed|name resolution"
    r"|empty address list|no addresses|failed to pick subchannel"
)
_HTTP_STATUS = re.compile(r"[1-5][0-9][0-9]")

Kind = Literal["ok", "timeout", "transport", "agent"]

STATUS_TABLE: dict[grpc.StatusCode, tuple[Kind, bool]] = {
    # code                               (Reach's reading, retryable)
    grpc.StatusCode.OK: ("ok", False),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("timeout", False),
    # No connection, or it broke: another attempt (maybe elsewhere) can succeed.
    grpc.StatusCode.UNAVAILABLE: ("transport", True),
    grpc.StatusCode.CANCELLED: ("transport", True),  # the agent's server cancelled (shutdown)
    # The agent is overloaded or failed on its side: it may succeed later.
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("agent", True),
    grpc.StatusCode.ABORTED: ("agent", True),
    grpc.StatusCode.INTERNAL: ("agent", True),
    grpc.StatusCode.UNKNOWN: ("agent", True),  # also an agent handler that raised
    grpc.StatusCode.DATA_LOSS: ("agent", True),
    # The agent refused this request: the same request gets the same answer.
    grpc.StatusCode.INVALID_ARGUMENT: ("agent", False),
    grpc.StatusCode.NOT_FOUND: ("agent", False),
    grpc.StatusCode.ALREADY_EXISTS: ("agent", False),
    grpc.StatusCode.PERMISSION_DENIED: ("agent", False),
    grpc.StatusCode.FAILED_PRECONDITION: ("agent", False),
    grpc.StatusCode.OUT_OF_RANGE: ("agent", False),
    grpc.StatusCode.UNIMPLEMENTED: ("agent", False),  # no such service or operation
    grpc.StatusCode.UNAUTHENTICATED: ("agent", False),
}
assert set(STATUS_TABLE) == set(grpc.StatusCode), "every gRPC status code is mapped"


def _trailing(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in exc.trailing_metadata() or ():
        if isinstance(value, str):
            found.setdefault(key.lower(), value)
    return found


def _text(value: str) -> str:
    return value.encode("utf-8", "replace").decode("utf-8").strip()


def said_status(trailing: Mapping[str, str]) -> int | None:
    """The HTTP-style status in `x-reach-status`, when it is one a failure can have."""
    value = trailing.get(GRPC_STATUS, "").strip()
    if not _HTTP_STATUS.fullmatch(value) or value in ("200", "202"):
        return None
    return int(value)


def error_for_answer(
    endpoint: Endpoint,
    status: int,
    details: str,
    said_type: str | None,
    withheld: bool,
    limit: int,
) -> ReachError:
    """An answer with an HTTP-style status, read by the table every other protocol is read with
    (`reply_for_status`): its words, its error type and retry flag cannot tell gRPC apart."""
    error: dict[str, object] = {"message": details.encode("utf-8", "replace").decode("utf-8")}
    if said_type is not None:
        error["type"] = said_type
    if withheld:
        error["retryable"] = False
    try:
        reply_for_status(endpoint, status, dumps({"error": error}), limit)
    except ReachError as exc:
        return exc
    return InternalError(  # said_status never lets a success status through
        f"gRPC connector read status {status} from {endpoint.instance_id} as a success"
    )


def error_for_status(
    endpoint: Endpoint,
    code: grpc.StatusCode,
    details: str,
    trailing: Mapping[str, str],
    receive_limit: int | None = None,
    limit: int | None = None,
) -> ReachError:
    """The Reach error a failed call's status stands for: `x-reach-status` through the shared
    HTTP-style table when the agent sent one, else the code through `STATUS_TABLE`.

    `receive_limit` is the channel's max_receive_message_length and `limit` the reply limit, to
    tell gRPC's refusal of a too-large reply from an agent refusing the payload.
    """
    kind, retryable = STATUS_TABLE[code]
    if kind == "ok":  # a caller's bug: OK is not a failure
        return InternalError(f"gRPC connector asked to map status OK from {endpoint.instance_id}")
    said_type = trailing.get(GRPC_ERROR_TYPE)
    withheld = trailing.get(GRPC_RETRYABLE, "").strip().lower() == "false"
    status = said_status(trailing)
    if status is not None:
        return error_for_answer(
            endpoint, status, details, said_type, withheld, limit or receive_limit or 0
        )
    name = code.name
    where = f"agent {endpoint.instance_id} answered gRPC {name}"
    fault = AgentFault(
        type=_text(said_type or "") or "agent_error", message=_text(details), status=code.value[0]
    )
    said = f": {fault.message}" if fault.message else ""
    if withheld:
        retryable = False  # an agent can never make a final code retryable
    if kind == "timeout":
        return DeadlineExceeded(
            f"agent {endpoint.instance_id} did not answer in time (gRPC {name}){said}"
        )
    if kind == "transport" and said_type is None:
        if _NOT_SENT.search(details):
            return TransportError(
                f"cannot reach agent at {endpoint.address}: {name}{said}", retryable=retryable
            )
        # The connection broke (agent killed, stream reset, the server going away) with the
        # call on it: sent, never answered, as an HTTP or WebSocket break mid-call.
        return TransportError(
            f"the connection to agent at {endpoint.address} broke mid-call: {name}{said}",
            retryable=retryable,
            outcome_unknown=True,
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        size = _TOO_BIG.search(details)
        if size is not None and receive_limit is not None and int(size[2]) == receive_limit:
            error = too_large(endpoint, size[1], limit if limit is not None else receive_limit)
            error.fault = fault
            return error
        if size is not None:
            return AgentError(
                f"{where}: it refused the payload as too large{said}", retryable=False, fault=fault
            )
    return AgentError(f"{where}{said}", retryable=retryable, fault=fault)


def reply_of(endpoint: Endpoint, raw: bytes, limit: int) -> Reply:
    """The Reply in an OK call's bytes, or the non-retryable `AgentError` they amount to."""
    where = f"agent {endpoint.instance_id} answered 200"  # gRPC OK, worded as on every protocol
    try:
        reply = InvokeReply.FromString(raw)
    except DecodeError as exc:
        raise AgentError(
            f"{where} with bytes that are not an InvokeReply", retryable=False
        ) from exc
    if reply.accepted:
        return Reply(status="accepted")
    try:
        data = parse_json(reply.result, what="result") if reply.result else {}
        result = data if isinstance(data, dict) else {"value": data}
        # As Reach will carry it: re-encoded, within the limit, nesting and charset rules.
        check_json(result, what="its result", limit=limit)
    except ReachError as exc:
        raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
    return Reply(status="ok", result=result)


@contextlib.contextmanager
def map_grpc_exceptions(endpoint: Endpoint, receive_limit: int, limit: int) -> Iterator[None]:
    """The one place grpcio's exceptions (and the call's own deadline) become Reach errors.

    `receive_limit` is the channel's max_receive_message_length, `limit` the reply limit.
    """
    try:
        yield
    except TimeoutError as exc:  # asyncio.timeout: the whole call, whatever gRPC was doing
        raise DeadlineExceeded(f"agent at {endpoint.address} did not answer in time") from exc
    except grpc.aio.AioRpcError as exc:
        raise error_for_status(
            endpoint,
            exc.code(),
            exc.details() or "",
            _trailing(exc),
            receive_limit=receive_limit,
            limit=limit,
        ) from exc
    except grpc.aio.InternalError as exc:  # grpc core refused to start the call (its batch)
        raise TransportError(
            f"cannot send this request to agent at {endpoint.address}: {exc!r}", retryable=False
        ) from exc
    except (grpc.aio.BaseError, grpc.RpcError) as exc:
        # A closed channel used, or a non-aio error from the aio API: nothing the agent did.
        raise InternalError(
            f"gRPC connector misused grpcio for {endpoint.address}: {exc!r}"
        ) from exc
