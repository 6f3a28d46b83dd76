"""Redaction for what leaves the process as a record (R20): the audit log, debug dumps.

`redact(value)` returns a new JSON-like structure in which

- the value under a secret key is `"***"`, whatever its type (a nested dict or list included);
- a string longer than `max_string` characters becomes `{"len": <characters>, "sha256": <hex of
  its UTF-8 bytes>}`: enough to tell two texts apart or match one, nothing to read it back;
- bytes (any length) become `{"len": <bytes>, "sha256": <hex>}`;
- tuples and sets become lists, mappings become dicts, pydantic models and dataclasses become
  dicts of their fields; int, float, bool and None pass (a non-finite float becomes its string);
  any other object becomes `str(obj)`, then the string rule applies;
- containers deeper than `max_depth` become `"<too deep>"`, a container met again on its own path
  becomes `"<cycle>"`, and values past the `max_items`-th become `"<truncated>"`, so any input,
  however deep, cyclic or shared, is done in bounded time and never raises `RecursionError`.

Secret keys. A key is compared after normalising it (`str()` of a non-string key, lower case,
`-`, `_`, `.` and spaces removed) with each normalised secret name: it is secret when it *equals*
a name or *ends with* one. So with the default names (`password`, `token`, `secret`, `api_key`,
`authorization`, `credentials`) `Password`, `apiKey`, `API-Key`, `X_API_KEY`, `x-api-key`,
`db_password`, `access_token`, `refreshToken`, `client_secret` and `Proxy-Authorization` are all
secret. The suffix rule is why: secrets are usually named `<what>_<kind>`. It errs on the masking
side (`csrf_token`, `next_page_token` are masked too) and it does not look at prefixes, so
`password_hash` or `token_type` pass. The key itself is kept as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Container, Iterable, Mapping
from functools import lru_cache
from typing import Any, Final

from pydantic import BaseModel

from reach.config import SECRET_KEY_NAMES
from reach.limits import MAX_DEPTH

__all__ = ["MASK", "Redactor", "digest", "normalise_key", "redact"]

MASK: Final = "***"
TOO_DEEP: Final = "<too deep>"
CYCLE: Final = "<cycle>"
TRUNCATED: Final = "<truncated>"
DEFAULT_MAX_ITEMS: Final = 100_000
_KEY_CACHE_SIZE: Final = 4096
_SEPARATORS: Final = str.maketrans("", "", "-_. ")


def normalise_key(key: object) -> str:
    """The form keys and secret names are compared in: lower case, no `-`, `_`, `.`, spaces."""
    text = key if isinstance(key, str) else str(key)
    return text.lower().translate(_SEPARATORS)


def digest(data: str | bytes) -> dict[str, Any]:
    """`{"len", "sha256"}` of a text (its characters; the hash of its UTF-8) or of bytes."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return {"len": len(data), "sha256": hashlib.sha256(raw).hexdigest()}


class Redactor:
    """`redact` with its settings fixed, for a hot path: secret names normalised once and the
    verdict per string key cached. Safe to share between threads."""

    def __init__(
        self,
        keys: Iterable[str] = SECRET_KEY_NAMES,
        *,
        max_string: int = 256,
        max_depth: int = MAX_DEPTH,
        max_items: int = DEFAULT_MAX_ITEMS,
        str_keys: bool = False,
    ) -> None:
        """`str_keys`: turn every mapping key into `str(key)` (what a JSON writer needs)."""
        # A name that normalises to "" would make every key secret by the suffix rule.
        self._names = tuple(sorted({n for n in map(normalise_key, keys) if n}))
        self._max_string = max_string
        self._max_depth = max_depth
        self._max_items = max_items
        self._str_keys = str_keys
        self._verdicts: dict[str, bool] = {}

    def is_secret_key(self, key: object) -> bool:
        if type(key) is str:
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._judge(key)
                if len(self._verdicts) >= _KEY_CACHE_SIZE:
                    self._verdicts.clear()  # keys chosen by callers must not grow this forever
                self._verdicts[key] = verdict
            return verdict
        return self._judge(key)

    def _judge(self, key: object) -> bool:
        return bool(self._names) and normalise_key(key).endswith(self._names)

    def __call__(self, value: Any) -> Any:
        return self._walk(value, 0, set(), [self._max_items])

    def _walk(self, value: Any, depth: int, path: set[int], budget: list[int]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            return TRUNCATED
        kind = type(value)
        if kind is str:
            return value if len(value) <= self._max_string else digest(value)
        if value is None or kind is int or kind is bool:
            return value
        if kind is dict or kind is list:
            return self._enter(value, depth, path, budget)
        if isinstance(value, str):
            return value if len(value) <= self._max_string else digest(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, bytes | bytearray | memoryview):
            return digest(bytes(value))
        if isinstance(value, Mapping | list | tuple | set | frozenset | BaseModel) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            return self._enter(value, depth, path, budget)
        try:
            text = str(value)
        except Exception:
            text = f"<unprintable {type(value).__name__}>"
        return text if len(text) <= self._max_string else digest(text)

    def _enter(self, value: Any, depth: int, path: set[int], budget: list[int]) -> Any:
        if depth >= self._max_depth:
            return TOO_DEEP
        ident = id(value)
        if ident in path:
            return CYCLE
        path.add(ident)
        try:
            return self._container(value, depth + 1, path, budget)
        finally:
            path.discard(ident)

    def _container(self, value: Any, depth: int, path: set[int], budget: list[int]) -> Any:
        if isinstance(value, BaseModel):
            names = _model_fields(value)
            items: Iterable[tuple[Any, Any]] = ((k, getattr(value, k)) for k in names)
        elif isinstance(value, Mapping):
            items = value.items()
        elif isinstance(value, list | tuple | set | frozenset):
            return [self._walk(item, depth, path, budget) for item in value]
        else:
            items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        return self._items(items, depth, path, budget)

    def _items(
        self,
        items: Iterable[tuple[Any, Any]],
        depth: int,
        path: set[int],
        budget: list[int],
        top: bool = False,
        skip: Container[str] = (),
    ) -> dict[Any, Any]:
        # The common case (a str key seen before, a short str, an int or None) is inlined: this
        # loop runs for every audit record on the gateway's hot path.
        verdicts = self._verdicts
        max_string = self._max_string
        str_keys = self._str_keys
        out: dict[Any, Any] = {}
        for key, item in items:
            if top and (item is None or key in skip):  # a record's own fields
                continue
            if type(key) is str:
                secret = verdicts.get(key)
                name = key
            else:
                secret = None
                name = str(key) if str_keys else key
            if secret is None:
                secret = self.is_secret_key(key)
            if secret:
                budget[0] -= 1
                out[name] = MASK
                continue
            kind = type(item)
            if (kind is str and len(item) <= max_string) or kind is int or item is None:
                budget[0] -= 1
                out[name] = item if budget[0] >= 0 else TRUNCATED
            else:
                out[name] = self._walk(item, depth, path, budget)
        return out

    def fields(self, fields: Mapping[str, Any], *, skip: Container[str] = ()) -> dict[str, Any]:
        """A redacted copy of a record's top level without its `None` values and `skip` keys."""
        return self._items(fields.items(), 0, set(), [self._max_items], top=True, skip=skip)


def _model_fields(model: BaseModel) -> list[str]:
    """A model's declared fields and extras, in order (what `model_dump` would name)."""
    names = list(type(model).model_fields)
    extra = model.__pydantic_extra__
    if extra:
        names.extend(k for k in extra if k not in names)
    return names


@lru_cache(maxsize=32)
def _redactor(keys: tuple[str, ...], max_string: int) -> Redactor:
    return Redactor(keys, max_string=max_string)


def redact(value: Any, *, keys: Iterable[str] = SECRET_KEY_NAMES, max_string: int = 256) -> Any:
    """A redacted copy of `value` (the input is never changed); the rules are the module's."""
    return _redactor(tuple(keys), max_string)(value)


def safe_url(url: str, limit: int = 200) -> str:
    """`url` fit for a log line or an error message: no userinfo, query or fragment (they may
    carry credentials), cut to `limit` characters."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        cleaned = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        if parts.query or parts.fragment or "@" in parts.netloc:
            cleaned += " (credentials, query and fragment not shown)"
    except ValueError:
        cleaned = "(an unparseable URL)"
    return cleaned[:limit]
