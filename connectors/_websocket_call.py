"""One WebSocket request's translation, for the WebSocket connector: the address
(`check_ws_address`, `ws_url`), the request frame (`request_frame`), what a reply frame means
(`read_reply`, through the table every protocol shares, `connectors._answers`), the largest frame
taken (`frame_limit`), and the one place websockets' exceptions become Reach errors
(`map_websocket_exceptions`). The contract they follow is docs/protocols/websocket.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    WebSocketException,
)

from agent_reach_proto import wire
from agent_reach_proto.wire import WS_DEFAULT_PATH
from connectors._address import check_http_address, refuse
from connectors._answers import reply_for_status
from reach.errors import AgentError, DeadlineExceeded, InternalError, TransportError
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps

# Room for the frame around a result, and for an agent escaping its non-ASCII text (\uXXXX is
# six bytes for a one-byte character): a reply past this ends the connection (close 1009).
FRAME_GROWTH = 6
FRAME_OVERHEAD = 64 * 1024

Frame = dict[str, Any]


# -- addresses ------------------------------------------------------------------------------------


def check_ws_address(address: str) -> str:
    """`address` normalized (lower-case scheme and host), or `InvalidRequest` naming the fault.

    The host, port and path rules are the HTTP connector's; only the schemes differ.
    """
    scheme, sep, rest = address.partition("://")
    if not sep:
        if "/" in address:
            raise refuse(address, "a path needs the URL form: ws://host:port/path")
        return check_http_address(address)
    kind = scheme.lower()
    if kind not in ("ws", "wss"):
        raise refuse(address, f"scheme {scheme!r} is not ws or wss")
    normalized = check_http_address(f"{'http' if kind == 'ws' else 'https'}://{rest}")
    return kind + normalized[normalized.index("://") :]


def ws_url(address: str) -> str:
    """The URL Reach connects to for a (checked) service address."""
    if "://" not in address:
        return f"ws://{address}{WS_DEFAULT_PATH}"
    scheme, _, rest = address.partition("://")
    authority, slash, path = rest.partition("/")
    return (
        f"{scheme}://{authority}/{path}"
        if slash and path
        else f"{scheme}://{authority}{WS_DEFAULT_PATH}"
    )


def wss_url(address: str) -> str:
    """The URL Reach connects to under mTLS: `host:port` is wss:// (ws:// is refused)."""
    return ws_url(address if "://" in address else f"wss://{address}")


def frame_limit(limit: int) -> int:
    """The largest frame accepted from an agent whose results may be `limit` bytes."""
    return FRAME_GROWTH * limit + FRAME_OVERHEAD


# -- frames ---------------------------------------------------------------------------------------


def request_frame(message: Message) -> bytes:
    """The request frame for `message`, encoded once as sent."""
    h = message.header
    frame = {
        wire.WS_TYPE: wire.WS_REQUEST,
        wire.WS_REQUEST_ID: h.request_id,
        wire.WS_OPERATION: h.operation,
        wire.WS_HEADERS: dict(wire.metadata(h)),
        wire.WS_PAYLOAD: message.payload,
    }
    try:
        return dumps(frame)
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise TransportError(
            f"cannot encode this request as a WebSocket frame: {exc}", retryable=False
        ) from exc


# The one RequestID named in a frame that could not be parsed (the SDK's server reads it too).
request_id_in = wire.request_id_in


def read_reply(endpoint: Endpoint, frame: Frame, limit: int) -> Reply:
    """The Reply a reply frame stands for, or the typed error (the shared status table)."""
    status = frame.get(wire.WS_STATUS)
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise AgentError(
            f"agent {endpoint.instance_id} sent a reply frame whose status {status!r:.40} is not "
            "an HTTP-style integer",
            retryable=False,
        )
    body = frame.get(wire.WS_BODY)
    try:
        raw = b"" if body is None else dumps(body)
    except (ValueError, RecursionError) as exc:  # NaN, Infinity, lone surrogates
        raise AgentError(
            f"agent {endpoint.instance_id} answered {status} with a body that is not "
            f"standard JSON: {exc}",
            retryable=False,
        ) from None
    return reply_for_status(endpoint, status, raw, limit)


# -- exceptions -----------------------------------------------------------------------------------


@contextlib.contextmanager
def map_websocket_exceptions(address: str) -> Iterator[None]:
    """The one place websockets' exceptions (and the call's deadline) become Reach errors.

    Whether a failure is retryable is whether sending the same request again could succeed.
    """
    try:
        yield
    except TimeoutError as exc:  # the call's own deadline
        raise DeadlineExceeded(f"agent at {address} did not answer in time") from exc
    except ConnectionClosed as exc:
        raise TransportError(f"the connection to agent at {address} broke: {exc}") from exc
    except InvalidURI as exc:
        raise TransportError(
            f"cannot connect to agent at {address}: {exc}", retryable=False
        ) from exc
    except InvalidStatus as exc:
        # 404: no WebSocket endpoint there, and there will not be one on the next attempt.
        code = exc.response.status_code
        raise TransportError(
            f"agent at {address} refused the WebSocket handshake: HTTP {code}",
            retryable=code >= 500 or code == 429,
        ) from exc
    except InvalidHandshake as exc:  # not a WebSocket server (yet): starting, or a proxy's page
        raise TransportError(
            f"agent at {address} did not complete a WebSocket handshake: {exc}"
        ) from exc
    except OSError as exc:  # refused, reset, unreachable, name resolution, TLS
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except WebSocketException as exc:
        # Protocol and state errors surface as ConnectionClosed; these mean misuse here.
        raise InternalError(
            f"WebSocket connector misused websockets for {address}: {exc!r}"
        ) from exc
