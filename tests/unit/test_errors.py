from __future__ import annotations

import httpx
import pytest

from connectors.http import map_httpx_exceptions
from gateway_api.routes.invoke import status_code_of
from reach.errors import ERRORS_BY_TYPE, ReachError, http_status_for
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
    assert http_status_for("never-heard-of-it") == 500


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


def _all_subclasses(cls: type[Exception]) -> list[type[Exception]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


@pytest.mark.parametrize(
    "exc_type",
    [httpx.TransportError, *_all_subclasses(httpx.TransportError)],
    ids=lambda c: c.__name__,
)
def test_every_httpx_transport_exception_is_mapped(exc_type: type[Exception]) -> None:
    with pytest.raises(ReachError) as err, map_httpx_exceptions("127.0.0.1:1"):
        raise exc_type("boom")  # type: ignore[call-arg]
    expected = "timeout" if issubclass(exc_type, httpx.TimeoutException) else "transport_error"
    assert err.value.type == expected
    assert isinstance(err.value.__cause__, exc_type)


def test_error_types_are_unique() -> None:
    assert len(ERRORS_BY_TYPE) == len({c.type for c in ERRORS_BY_TYPE.values()})
