"""Who may pass the door, decided the same way on every front (HTTP, gRPC) from local copies.

`Auth` answers three questions from a request's `Authorization` header: which caller invokes,
which agent registers/heartbeats/answers, whether an admin acts. Whether tokens are required
follows `auth.mode`: `tokens` always, `open` never, `auto` as soon as any token record exists
(revoked and expired ones count: revoking the last token never reopens the door).
"""

from __future__ import annotations

import ipaddress
import socket
import time

from reach.config import AuthSettings
from reach.errors import Forbidden, ReachError, Unauthorized
from reach.security.tokens import (
    ANY,
    TOKEN_PATTERN,
    FileTokenStore,
    Principal,
    TokenBook,
    TokenCache,
    bearer,
    check_claimed_caller,
    merge,
)

ANONYMOUS = "anonymous"
# An unknown token re-reads the tokens file at most this often per gateway (`Auth._reread_for`).
MISS_REREAD_S = 0.05


class Auth:
    def __init__(self, settings: AuthSettings, cache: TokenCache | None) -> None:
        self.settings = settings
        self.cache = cache
        self._once_required = False  # `auto` never reopens in this process once it closed
        self._reread_at = -MISS_REREAD_S  # when an unknown token last re-read the tokens file
        self._reread_stamp: tuple[int, int, int] | None = None  # the file as that read found it

    @property
    def required(self) -> bool:
        return self.required_under(self.settings)

    def required_under(self, settings: AuthSettings) -> bool:
        """Whether tokens are required with these settings (a reload is judged before use)."""
        if settings.mode == "open":
            return False
        if settings.mode == "tokens" or self._once_required:
            return True
        if self.cache is not None and len(self.cache.book) > 0:
            self._once_required = True
        return self._once_required

    def _verify(self, authorization: str | None) -> Principal:
        cache = self.cache
        token = bearer(authorization)
        if cache is None:
            raise Unauthorized("no token store is configured on this gateway")
        try:
            return cache.book.verify(token)
        except Unauthorized:
            if not self._reread_for(token, cache):
                raise
        return cache.book.verify(token)

    def _reread_for(self, token: str, cache: TokenCache) -> bool:
        """A well-formed token whose id this copy does not hold may have just been issued
        (`reach tokens issue` writes the host's file first; the file's poll, or the shared
        store's notice, would bring it a moment later): re-read that file now, at most once
        per `MISS_REREAD_S` in this gateway and only when the file changed since the last such
        read, so a flood of unknown tokens cannot hammer it (a stat, not a parse, per miss).
        True when the re-read brought a record of that id."""
        found = TOKEN_PATTERN.match(token)
        if found is None or found.group(1) in cache.book.records:
            return False  # malformed, or a known id: a wrong secret, revoked or expired
        store = cache.store
        local = store if isinstance(store, FileTokenStore) else getattr(store, "mirror", None)
        now = time.monotonic()
        if not isinstance(local, FileTokenStore) or now - self._reread_at < MISS_REREAD_S:
            return False
        stamp = local.stamp()
        if stamp is None or stamp == self._reread_stamp:
            return False  # no file, or the one already read: nothing new in it
        self._reread_at, self._reread_stamp = now, stamp
        try:
            records = local.read()  # a small local file, read in place: the request waits
        except (ReachError, OSError):
            return False
        # Kept whatever token asked: this read is the file's as of its stamp, which no later
        # miss reads again (a flood's miss read a token just issued, then threw it away).
        cache.book = TokenBook(merge(cache.book.records.values(), records).values())
        return any(r.id == found.group(1) for r in records)

    def caller(self, authorization: str | None, claimed: str | None) -> Principal:
        """The invoking principal. Without required tokens the caller names itself."""
        if not self.required:
            return Principal(name=claimed or ANONYMOUS, kind="caller")
        principal = self._verify(authorization)
        check_claimed_caller(principal, claimed)
        return principal

    def anyone(self, authorization: str | None) -> Principal | None:
        """Any valid token (reads: capabilities, request status); None when not required."""
        if not self.required:
            return None
        return self._verify(authorization)

    def agent(self, authorization: str | None) -> Principal | None:
        """An agent's (or an admin's) principal for Join, heartbeat, leave and late answers;
        None when tokens are not required."""
        if not self.required:
            return None
        principal = self._verify(authorization)
        if principal.kind not in ("agent", "admin"):
            raise Forbidden(
                f"token {principal.token_id} of {principal.name!r} is a {principal.kind} token; "
                "agents register and answer with an agent token (reach tokens issue --agent)"
            )
        return principal

    def admin(self, authorization: str | None) -> Principal:
        """An admin principal, always required (the admin API is never open)."""
        principal = self._verify(authorization)
        if principal.kind != "admin":
            raise Forbidden(f"the admin API needs an admin token, not a {principal.kind} token")
        return principal


def may_serve(principal: Principal | None, capability: str) -> None:
    """An agent token serves only the capabilities it names (admins: any)."""
    if principal is None or principal.kind == "admin" or ANY in principal.capabilities:
        return
    if capability not in principal.capabilities:
        raise Forbidden(
            f"the token of {principal.name!r} may serve "
            f"{', '.join(sorted(principal.capabilities)) or 'no capability'}, not {capability!r}"
        )


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def exposure_problem(mode: str, host: str, required: bool) -> str | None:
    """Why the gateway must not start on `host` (None: it may). No tokens and not `open` ->
    loopback only."""
    if required or mode == "open" or is_loopback_host(host):
        return None
    return (
        f"refusing to serve {host} without authentication: no token exists yet. Issue one "
        "(`reach tokens issue --principal NAME`), set auth.mode: tokens, or write "
        "auth.mode: open in the configuration to serve it open on purpose"
    )
