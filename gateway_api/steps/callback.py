"""Step 4, vet the callback: request forgery is refused before anything is started.

A callback URL must be http(s) and its host resolve to allowed addresses
(`security.allow_networks`), else 422 naming the URL (credentials masked).
"""

from __future__ import annotations

from reach.errors import InvalidRequest
from reach.security.netguard import AddressGuard
from reach.security.redact import safe_url


async def vet_callback(guard: AddressGuard, url: str) -> None:
    try:
        await guard.check_url(url)
    except InvalidRequest as exc:
        raise InvalidRequest(f"callback {safe_url(url)!r}: {exc.message}") from None
