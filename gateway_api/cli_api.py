"""The CLI's client of the gateway's API: one small synchronous client that turns every failure
into `Failed` with the fix named, the options every gateway command takes, and the exit codes
the commands share (0 done, 1 the call failed, 2 bad arguments, 3 no gateway there).

The client is the standard library's `http.client`, not httpx: these are a few small requests
from a short-lived process, and importing httpx took longer than the requests themselves (issue
26: `reach agents` started in 1.5 s, most of it imports). It is imported when a command first
calls, so `reach --help` does not load it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import http.client
    import ssl

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


class _Unreachable(Exception):
    """The call did not get an HTTP answer: `reason` says why, as a person reads it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _ReadTimeout(Exception):
    """The request went out and no answer came within the read timeout."""


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


def _reason(exc: BaseException) -> str:
    """A transport failure in a few words (the wording the httpx-based client used)."""
    import http.client
    import socket

    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "Server disconnected without sending a response."
    if isinstance(exc, http.client.BadStatusLine):
        return f"illegal status line: {str(exc).strip()!r}"
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    if "refused" in lowered:
        return "connection refused"
    if isinstance(exc, socket.gaierror) or "name or service not known" in lowered:
        return "unknown host"
    return text


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return None


class Api:
    """A small synchronous client of the gateway's API that turns every failure into `Failed`
    with the fix named."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Accept": "application/json", "User-Agent": "reach-cli"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.has_token = bool(token)
        # One connection, kept alive across a command's requests (`reach agents` makes one per
        # capability). No proxy from the environment: it must not stand between the CLI and a
        # gateway on this machine (the usual case).
        self._conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

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
        try:
            status, content_type, raw = self._exchange(method, path, body, read_timeout_s)
        except _ReadTimeout:
            raise NoAnswer(
                f"the gateway at {self.base_url} accepted the call but did not answer within "
                f"{read_timeout_s:g}s"
            ) from None
        except _Unreachable as exc:
            raise Failed(
                f"cannot reach the gateway at {self.base_url}: {exc.reason} — start it with "
                "`reach up` (or `reach gateway`) or set --gateway",
                EXIT_UNREACHABLE,
            ) from None
        if status == 204 and status in ok:
            return status, {}  # done, nothing to say (a DELETE)
        data = _json_or_none(raw)
        if not isinstance(data, dict):
            kind = content_type or "no content type"
            raise Failed(
                f"{self.base_url}{path} did not answer as a Reach gateway (HTTP "
                f"{status}, {kind}) — check --gateway"
            )
        if status == 401:
            raise Failed(self._unauthorized(data))
        if status == 403:
            raise Failed(error_text(data))  # `forbidden: <why>`, its type said once
        if status not in ok:
            said = error_text(data)
            raise Failed(said + _hint(status, path, said))
        return status, data

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

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        """The open connection (made on first use, in CONNECT_TIMEOUT_S) and the URL's path
        prefix. Raises _Unreachable."""
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https"):
            raise _Unreachable(
                "Request URL is missing an 'http://' or 'https://' protocol."
                if not url.scheme
                else f"Request URL has an unsupported protocol '{url.scheme}://'."
            )
        if self._conn is None:
            try:
                host, port = url.hostname, url.port
            except ValueError as exc:  # a port that is no number, or out of range
                raise _Unreachable(str(exc)) from None
            if not host:
                raise _Unreachable("unknown host")
            if url.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=CONNECT_TIMEOUT_S, context=_tls_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
            try:
                conn.connect()
            except (OSError, OverflowError) as exc:
                conn.close()
                raise _Unreachable(_reason(exc)) from None
            self._conn = conn
        return self._conn, url.path.rstrip("/")

    def _exchange(
        self, method: str, path: str, body: dict[str, Any] | None, read_timeout_s: float | None
    ) -> tuple[int, str | None, bytes]:
        """One request and its whole answer: (status, content type, body bytes)."""
        import http.client

        reused = self._conn is not None
        conn, prefix = self._connection()
        headers = dict(self._headers)
        content = None
        if body is not None:
            content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
        sent = False
        try:
            assert conn.sock is not None
            conn.sock.settimeout(read_timeout_s)
            conn.request(method, _quoted(prefix + path), body=content, headers=headers)
            sent = True
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self._close()
            if sent and isinstance(exc, TimeoutError):
                raise _ReadTimeout from None
            if reused and method == "GET" and _stale(exc):
                # The gateway closed the kept-alive connection between two calls: once more on
                # a new one (a GET has no effect to repeat).
                return self._exchange(method, path, body, read_timeout_s)
            raise _Unreachable(_reason(exc)) from None
        if response.will_close:
            self._close()
        return response.status, response.headers.get("content-type"), raw


def _quoted(target: str) -> str:
    """The request target with what may not go raw on the wire percent-encoded (a space in a
    capability's name, say), as httpx sent it; `%XX` already there is kept."""
    from urllib.parse import quote

    return quote(target, safe="/:@!$&'()*+,;=?%~")


def _stale(exc: BaseException) -> bool:
    import http.client

    return isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError)


def _tls_context() -> ssl.SSLContext:
    """The CA bundle httpx verified the gateway with (certifi's), else the system's; as before,
    SSL_CERT_FILE and SSL_CERT_DIR are not read."""
    import ssl

    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


def error_text(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        kind, message = error.get("type"), str(error.get("message", ""))
        # The type once: not again when the message starts with it, nor `error:` for none
        # (the CLI's own `error:` comes before it).
        bare = not kind or message.startswith(f"{kind}:")
        text = message if bare else f"{kind}: {message}"
        agent = error.get("agent")
        if isinstance(agent, dict):
            said = str(agent.get("message", ""))
            # Reach's message often quotes the agent's already (an MCP tool's error): its type
            # alone then, not the same text twice.
            new = bool(said) and said not in message
            text += f" (agent: {agent.get('type', '?')}" + (f": {said}" if new else "") + ")"
        return clean(text)
    detail = data.get("detail")
    return clean(str(detail if detail is not None else data))


def _hint(status: int, path: str, said: str = "") -> str:
    if status == 404 and path.startswith("/reach/capabilities/"):
        return " — `reach capabilities` lists the known ones"
    if status == 404 and path.endswith("/timeline") and "refused at the door" not in said:
        return (
            " — `reach requests` lists recent ones; a request the door refused never started "
            "and has no timeline (the gateway's audit trail has its refusal); another caller's "
            "request reads as unknown too (an admin token reads every one)"
        )
    return ""


def clean(text: str) -> str:
    """Agent-provided text made safe for a terminal: control characters (escape sequences
    that could rewrite the screen) are shown escaped, not sent."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )
