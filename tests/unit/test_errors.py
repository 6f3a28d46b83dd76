from __future__ import annotations

import pytest

from gateway_api.routes.invoke import status_code_of
from reach.errors import ERRORS_BY_TYPE, http_status_for
from reach.messages import ErrorInfo, InvokeResponse

DOCUMENTED = {
    "invalid_request": 422,
    "payload_too_large": 413,
    "unauthorized": 401,
    "forbidden": 403,
    "unknown_capability": 404,
    "rate_limited": 429,
    "no_instance": 503,
    "circuit_open": 503,
    "timeout": 504,
    "agent_error": 502,
    "transport_error": 502,
}


def test_every_documented_error_type_has_its_status_code() -> None:
    for error_type, code in DOCUMENTED.items():
        assert http_status_for(error_type) == code
        assert ERRORS_BY_TYPE[error_type]("m").type == error_type


def test_an_agents_own_error_type_never_chooses_the_status() -> None:
    """The vocabulary is closed: a foreign type (e.g. recorded from an agent's late answer by an
    older version) reads back as agent_error 502, the agent's words kept inside."""
    info = ErrorInfo.model_validate({"type": "not_found", "message": "gone"})
    assert info.type == "not_found"  # Reach's own type: kept
    for foreign in ("index_missing", "internal_server_error", "503", ""):
        info = ErrorInfo.model_validate({"type": foreign, "message": "the agent's words"})
        assert info.type == "agent_error"
        assert info.agent is not None
        assert info.agent.message == "the agent's words"
        assert status_code_of(InvokeResponse(request_id="r", status="error", error=info)) == 502
    with pytest.raises(KeyError):
        http_status_for("never-heard-of-it")  # type: ignore[arg-type]


def test_envelope_status_codes() -> None:
    def env(status: str, etype: str | None = None) -> InvokeResponse:
        error = ErrorInfo(type=etype, message="m") if etype else None
        return InvokeResponse(request_id="r", status=status, error=error)  # type: ignore[arg-type]

    assert status_code_of(env("success")) == 200
    assert status_code_of(env("accepted")) == 202
    assert status_code_of(env("running")) == 200
    assert status_code_of(env("timeout", "timeout")) == 504
    assert status_code_of(env("error", "no_instance")) == 503
    assert status_code_of(env("error", "agent_error")) == 502


def test_error_types_are_unique() -> None:
    assert len(ERRORS_BY_TYPE) == len({c.type for c in ERRORS_BY_TYPE.values()})
