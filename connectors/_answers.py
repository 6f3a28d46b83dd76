"""What an agent's answer means, the same on every protocol that carries an HTTP-style status.

HTTP carries it as the response status, WebSocket frames and MQTT replies as a `status` field,
and the SDK's gRPC agents as the `x-reach-status` trailer (docs/protocols/, a page each).
One table decides, deliberately:

    200             result (a JSON object; any other JSON value is wrapped as {"value": ...})
    202             accepted: the answer comes later as a late answer
    504             timeout (the agent ran out of the request's deadline)
    404             agent_error, not retryable (operation not served)
    413             agent_error, not retryable (the payload was within what was negotiated;
                    the agent disagrees, and another attempt would send the same bytes)
    429, 5xx        agent_error, retryable
    other           agent_error, not retryable

An error body `{"error": {"type", "message", "retryable"}}` is the agent's own account: it travels
as the `AgentFault` of an `agent_error` and never chooses Reach's error type; `"retryable": false`
can withhold a retry, never ask for one. A result is re-encoded and checked as Reach will carry
it (size within the negotiated limit, nesting, charset).
"""

from __future__ import annotations

from typing import Any

from reach.acceptance import check_json, parse_json
from reach.errors import AgentError, AgentFault, DeadlineExceeded, ReachError
from reach.invocation import Endpoint
from reach.messages import Reply


def too_large(endpoint: Endpoint, size: str, limit: int) -> AgentError:
    return AgentError(
        f"agent {endpoint.instance_id} answered {size} bytes; the negotiated "
        f"max_message_bytes is {limit}",
        retryable=False,
    )


def _text(value: object) -> str:
    # A JSON escape can smuggle in a lone surrogate, which no later hop could encode.
    return str(value).encode("utf-8", "replace").decode("utf-8")


def fault_of(raw: bytes, code: int) -> tuple[AgentFault, bool]:
    """What the agent said about its failure, whatever shape it said it in, and whether it
    said another attempt could not help."""
    try:
        body = parse_json(raw, what="error body")
    except ReachError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        fault = AgentFault(
            type=_text(err.get("type") or "agent_error"),
            message=_text(err.get("message") or ""),
            status=code,
        )
        return fault, err.get("retryable") is False
    return AgentFault(message=raw.decode("utf-8", "replace").strip(), status=code), False


def reply_for_status(endpoint: Endpoint, code: int, raw: bytes, limit: int) -> Reply:
    """The Reply for status `code` with body `raw`, or the typed error it stands for.

    The message never names the protocol: the same answer reads the same whichever protocol
    carried it, so a caller cannot tell them apart.
    """
    where = f"agent {endpoint.instance_id} answered {code}"
    if code == 200:
        try:
            data: Any = parse_json(raw, what="result") if raw else {}
            result = data if isinstance(data, dict) else {"value": data}
            # As Reach will carry it: re-encoded, within the limit, nesting and charset rules.
            check_json(result, what="its result", limit=limit)
        except ReachError as exc:
            raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
        return Reply(status="ok", result=result)
    if code == 202:
        return Reply(status="accepted")
    fault, final = fault_of(raw, code)
    said = f": {fault.message}" if fault.message else ""
    if code == 504:
        raise DeadlineExceeded(f"{where}{said}")
    if code == 404:
        raise AgentError(f"{where}: operation not served{said}", retryable=False, fault=fault)
    if code == 413:
        raise AgentError(
            f"{where}: it refused the payload as too large{said}", retryable=False, fault=fault
        )
    retryable = (code >= 500 or code == 429) and not final
    raise AgentError(f"{where}{said}", retryable=retryable, fault=fault)
