"""The CLI's client of the gateway's API: one small synchronous client that turns every failure
into `Failed` with the fix named, the options every gateway command takes, and the exit codes
the commands share (0 done, 1 the call failed, 2 bad arguments, 3 no gateway there).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import httpx

TOKEN_ENV = "REACH_TOKEN"
EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
CONNECT_TIMEOUT_S = 5.0


class Failed(Exception):
    """A clear one-line (or few-line) error for stderr, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class NoAnswer(Failed):
    """The gateway took the call and did not answer in time."""


def gateway_options() -> argparse.ArgumentParser:
    """--gateway, --token and --json: every command that talks to the gateway takes them."""
    gateway = argparse.ArgumentParser(add_help=False)
    gateway.add_argument(
        "--gateway", metavar="URL", help="the gateway's URL (default: the configured one)"
    )
    gateway.add_argument(
        "--token", help=f"a bearer token when the gateway requires one (default: ${TOKEN_ENV})"
    )
    gateway.add_argument("--json", action="store_true", help="machine-readable output")
    return gateway


def _reason(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    if "refused" in lowered:
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return "unknown host"
    return text


class Api:
    """A small synchronous client of the gateway's API that turns every failure into `Failed`
    with the fix named."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "reach-cli"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.has_token = bool(token)
        # trust_env off: a proxy from the environment must not stand between the CLI and a
        # gateway on this machine (the usual case).
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            trust_env=False,
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
        )

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        read_timeout_s: float | None = 30.0,
        ok: Sequence[int] = (200,),
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body). A status outside `ok` that is not an envelope the caller
        wants raises `Failed`; envelopes (invoke, request status) come back as they are."""
        timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            response = self._client.request(method, path, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            raise NoAnswer(
                f"the gateway at {self.base_url} accepted the call but did not answer within "
                f"{read_timeout_s:g}s"
            ) from None
        except httpx.TransportError as exc:
            raise Failed(
                f"cannot reach the gateway at {self.base_url}: {_reason(exc)} — start it with "
                "`reach up` (or `reach gateway`) or set --gateway",
                EXIT_UNREACHABLE,
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            kind = response.headers.get("content-type", "no content type")
            raise Failed(
                f"{self.base_url}{path} did not answer as a Reach gateway (HTTP "
                f"{response.status_code}, {kind}) — check --gateway"
            )
        if response.status_code == 401:
            raise Failed(self._unauthorized(data))
        if response.status_code == 403:
            raise Failed(f"forbidden: {error_text(data)}")
        if response.status_code not in ok:
            raise Failed(error_text(data) + _hint(response.status_code, path))
        return response.status_code, data

    def _unauthorized(self, data: dict[str, Any]) -> str:
        if self.has_token:
            return (
                f"the gateway refused the token ({error_text(data)}) — set REACH_TOKEN or "
                "--token to a valid one (reach tokens list; reach tokens issue --principal NAME)"
            )
        return (
            "the gateway requires a token — set REACH_TOKEN (or --token) to one from "
            "`reach tokens issue --principal NAME`"
        )


def error_text(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        text = f"{error.get('type', 'error')}: {error.get('message', '')}"
        agent = error.get("agent")
        if isinstance(agent, dict):
            text += f" (agent: {agent.get('type', '?')}: {agent.get('message', '')})"
        return clean(text)
    detail = data.get("detail")
    return clean(str(detail if detail is not None else data))


def _hint(status: int, path: str) -> str:
    if status == 404 and path.startswith("/reach/capabilities/"):
        return " — `reach capabilities` lists the known ones"
    if status == 404 and path.endswith("/timeline"):
        return " — `reach requests` lists recent ones"
    return ""


def clean(text: str) -> str:
    """Agent-provided text made safe for a terminal: control characters (escape sequences
    that could rewrite the screen) are shown escaped, not sent."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )
