"""Web pages may not drive an open gateway: the Host and Origin checks for every HTTP route.

A gateway without required tokens (`auth.mode: auto` before any token exists, or `open`)
answers whoever reaches it, and a browser reaches a loopback gateway for any page it shows:

- **cross-site requests**: a page on any site may POST to `http://127.0.0.1:7600/reach/invoke`
  with a body the browser sends without asking first (`Content-Type: text/plain`: a CORS
  "simple request"), so the invoke runs, though the page cannot read the answer;
- **DNS rebinding**: a page whose own name the attacker re-points at 127.0.0.1 reads the
  answers too, as the same origin (its requests carry that name as their `Host`).

So, while tokens are not required, a request is refused (403 `forbidden`) when its `Host` is not
this gateway's name (a gateway listening on one address: loopback names, that address and
`public_url`'s name; one listening on every address answers to any name), or when it carries an
`Origin` that is neither loopback, `public_url`'s name nor its own `Host`'s. Programs (agents,
SDKs, the CLI, curl) send no `Origin`; the dashboard's own requests come from the gateway's
origin. With tokens required nothing here applies: a browser sends no bearer token by itself.
The MCP front applies the same rules itself (`gateway_api.mcp_front`), as JSON-RPC errors.
"""

from __future__ import annotations

from starlette.types import Scope, Send

from gateway_api._mcp_http import host_allowed, hostname, origin_allowed
from reach.config import ReachSettings
from reach.messages import dumps


def refusal(settings: ReachSettings, scope: Scope) -> str | None:
    """Why an open gateway refuses this HTTP request from a browser (None: it does not)."""
    host: str | None = None
    origin: str | None = None
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
        elif name == b"origin":
            origin = value.decode("latin-1")
    name_of_host = hostname(host or "")
    if not host_allowed(settings, name_of_host):
        return f"Host {(host or '')[:100]!r} is not this gateway's name"
    if origin is not None and not origin_allowed(
        settings, hostname(origin, url=True), name_of_host, tokens=True
    ):
        return f"Origin {origin[:100]!r} may not call this gateway (it requires no tokens)"
    return None


async def refuse(send: Send, said: str) -> None:
    body = dumps(
        {
            "request_id": None,
            "status": "error",
            "error": {"type": "forbidden", "message": said, "retryable": False},
        }
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})
