"""The guard at the door, in a gateway process: tokens (a local copy), rules, audit, and how they
change without a restart (R26).

Sources of change, each validated before it replaces anything and each audited:
- the configuration file, re-read when it changes (`ConfigWatcher`): an invalid file is
  refused and logged, and the rules, limits and auth mode in force stay;
- the admin API: tokens (in the token store, seen by every gateway within a second) and a
  rules override kept in the shared store (every gateway sharing the store applies it; the
  file's rules come back when the override is cleared).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from reach.config import ConfigError, ReachSettings, RuleSettings
from reach.errors import Forbidden, ReachError
from reach.security.audit import AuditLog
from reach.security.auth import Auth, exposure_problem
from reach.security.refusals import DoorRefusals
from reach.security.rules import Decision, RuleBook
from reach.security.tokens import (
    FileTokenStore,
    SharedTokenStore,
    TokenCache,
    TokenStore,
    mirror_path,
)
from reach.settings_checks import load_checked_settings
from reach.store import Store

log = logging.getLogger("reach.security")

RULES_KEY = "auth:rules"
RULES_CHANNEL = "auth:rules"
CONFIG_POLL_S = 0.5
_RULES = TypeAdapter(list[RuleSettings])

# Sections a running gateway applies at once; the rest need a restart (and say so). Routing
# (the defaults, and each capability's) is applied where this gateway routes; a capability's
# `mode` and the audit trail's sink are not (`_needs_restart`).
LIVE_SECTIONS = frozenset({"rules", "auth", "policy", "routing"})
# Audit fields applied live: the redaction (so the CLI's records and the gateway's agree).
LIVE_AUDIT_FIELDS = frozenset({"redact_keys", "max_string"})


def token_store(settings: ReachSettings, store: Store | None) -> TokenStore:
    """Redis registry: tokens in Redis (every gateway), mirrored in this host's tokens file;
    memory: the tokens file on this host."""
    if settings.registry.type == "redis" and store is not None:
        mirror = mirror_path(settings.auth.tokens_file, settings.registry.key_prefix)
        return SharedTokenStore(store, FileTokenStore(mirror))
    return FileTokenStore(settings.auth.tokens_file)


class Guard:
    def __init__(self, settings: ReachSettings, store: Store | None) -> None:
        self.settings = settings
        self.store = store
        self.tokens = token_store(settings, store)
        self.cache = TokenCache(self.tokens, resync_s=settings.auth.resync_s)
        self.auth = Auth(settings.auth, self.cache)
        self.audit = AuditLog(settings.audit)
        self.refusals = DoorRefusals()  # what `reach trace` says of a refused RequestID
        self.file_rules: list[RuleSettings] = list(settings.rules)
        self.override: list[RuleSettings] | None = None
        self.rules = RuleBook(self.file_rules)
        self._stoppers: list[Callable[[], Awaitable[None]]] = []

    async def start(self) -> None:
        await self.audit.start()
        await self.cache.start()
        if self.store is not None:
            await self._read_override()
            sub = await self.store.subscribe(RULES_CHANNEL, self._override_changed)
            self._stoppers.append(sub.aclose)

    async def aclose(self) -> None:
        for stop in self._stoppers:
            with contextlib.suppress(Exception):
                await stop()
        await self.cache.aclose()
        await self.audit.aclose()

    # -- decisions ----------------------------------------------------------------------------

    def decide(
        self, caller: str, capability: str, operation: str, request_id: str | None = None
    ) -> Decision:
        """R19 for one request; a denial is audited and raised as 403 naming the rule."""
        decision = self.rules.decide(caller, capability, operation)
        if not decision.allowed:
            self.audit.record(
                "denied",
                request_id=request_id,
                caller=caller,
                capability=capability,
                operation=operation,
                status=403,
                error_type="forbidden",
                rule=decision.rule,
                reason=decision.reason,
            )
            raise Forbidden(decision.reason)
        return decision

    @property
    def rules_source(self) -> str:
        return "admin" if self.override is not None else "file"

    # -- live changes -------------------------------------------------------------------------

    def apply(self, new: ReachSettings, source: str, principal: str | None = None) -> list[str]:
        """Take a validated configuration; returns the sections that need a restart."""
        old = self.settings
        changed = [
            name for name in type(new).model_fields if getattr(old, name) != getattr(new, name)
        ]
        self.settings = new
        self.auth.settings = new.auth
        self.file_rules = list(new.rules)
        if self.override is None:
            self.rules = RuleBook(self.file_rules)
        self.audit.redact_as(new.audit)
        restart = [name for name in changed if _needs_restart(name, old, new)]
        self.audit.record(
            "config_changed", principal=principal, source=source, sections=changed, restart=restart
        )
        log.info(
            "configuration reloaded from %s: %s changed%s",
            source,
            ", ".join(changed) or "nothing",
            f" ({', '.join(restart)} only after a restart)" if restart else "",
        )
        return restart

    def refuse(self, source: str, problem: str, principal: str | None = None) -> None:
        self.audit.record("config_rejected", principal=principal, source=source, reason=problem)
        log.error("configuration change refused, the running one stays: %s", problem)

    async def set_override(self, rules: Sequence[RuleSettings] | None, principal: str) -> None:
        """Replace the file's rules with `rules` on every gateway sharing the store (None:
        back to the file's)."""
        if self.store is None:
            raise ReachError("no shared store to keep a rules override in")
        body = "" if rules is None else json.dumps([r.model_dump(mode="json") for r in rules])
        await self.store.hash_set(RULES_KEY, "rules", body)
        self._use_override(list(rules) if rules is not None else None)
        self.audit.record(
            "rules_changed",
            principal=principal,
            source="admin",
            rules=len(rules) if rules is not None else None,
        )
        await self.store.publish(RULES_CHANNEL, "changed")

    def _use_override(self, rules: list[RuleSettings] | None) -> None:
        self.override = rules
        self.rules = RuleBook(rules if rules is not None else self.file_rules)

    def _override_changed(self, _message: str | None) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._read_override())

    async def _read_override(self) -> None:
        if self.store is None:
            return
        try:
            raw = (await self.store.hash_all(RULES_KEY)).get("rules", "")
        except ReachError as exc:
            log.warning("could not read the rules override (keeping the rules in force): %s", exc)
            return
        if not raw:
            self._use_override(None)
            return
        try:
            self._use_override(_RULES.validate_json(raw))
        except ValidationError as exc:
            log.error("the stored rules override is invalid and is ignored: %s", exc)


class ConfigWatcher:
    """Re-read the configuration file when it changes; apply it only once it validates."""

    def __init__(
        self,
        guard: Guard,
        path: Path,
        *,
        on_apply: Callable[[ReachSettings], None] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.guard = guard
        self.path = path
        self.on_apply = on_apply
        self.overrides = overrides or {}
        self._task: asyncio.Task[None] | None = None
        self._seen = self._stamp()
        self.last_problem: str | None = None
        self.last_restart: list[str] = []

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        settling: tuple[int, int] | None = None
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            stamp = self._stamp()
            if stamp == self._seen or stamp is None:
                settling = None
                continue
            if stamp != settling:
                # Changed since the last look: read it once it has stayed the same for a poll
                # (an editor or `cat >` passes through empty and half-written states).
                settling = stamp
                continue
            self._seen, settling = stamp, None
            self.check()

    def check(self, principal: str | None = None) -> bool:
        """Read the file now; apply it if valid. True when applied."""
        try:
            new = self._read()
        except ConfigError as exc:
            self.last_problem = str(exc)
            self.guard.refuse(str(self.path), str(exc), principal)
            return False
        self.last_problem = None
        self.last_restart = self.guard.apply(new, str(self.path), principal)
        if self.on_apply is not None:
            self.on_apply(new)
        return True

    def _read(self) -> ReachSettings:
        """The file's settings, refused when it cannot be what was meant: no `reach:` mapping
        (empty, comments only), or serving beyond loopback without tokens."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read {self.path}: {exc.strerror}") from exc
        try:
            raw = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self.path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("reach"), dict):
            raise ConfigError(
                f"{self.path} holds no 'reach:' mapping (empty or half-written?); "
                "a running gateway does not reset itself to the defaults"
            )
        new = load_checked_settings(self.path, **self.overrides)
        running = self.guard.settings.listen_host
        problem = exposure_problem(new.auth.mode, running, self.guard.auth.required_under(new.auth))
        if problem is not None:
            raise ConfigError(problem.replace("refusing to serve", "refusing to keep serving"))
        if new.auth.mode == "open" and self.guard.auth.required:
            # Opening a closed door stops every token from mattering at once (a revoked one
            # too): a decision for a restart, never for a file edit a running gateway picks up.
            raise ConfigError(
                "auth.mode: open would stop requiring the tokens this gateway holds; a "
                "running gateway does not open its door: set it and restart"
            )
        return new

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _needs_restart(section: str, old: ReachSettings, new: ReachSettings) -> bool:
    if section in LIVE_SECTIONS:
        return False
    if section == "capabilities":  # live unless a capability's mode (its workers) changed
        names = old.capabilities.keys() | new.capabilities.keys()
        return any(old.capability_mode(n) != new.capability_mode(n) for n in names)
    if section == "audit":
        before = old.audit.model_dump(exclude=set(LIVE_AUDIT_FIELDS))
        return before != new.audit.model_dump(exclude=set(LIVE_AUDIT_FIELDS))
    return True
