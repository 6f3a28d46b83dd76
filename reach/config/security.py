"""The sections of the one door's guards: tokens, rules, audit, mTLS, encryption (R18-R20)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from reach.config.base import Section
from reach.config.parsing import decode_key, parse_networks

SECRET_KEY_NAMES = (
    "password",
    "token",
    "secret",
    "api_key",
    "authorization",
    "credentials",
    "passwd",
    "passphrase",
    "private_key",
    "cookie",
)


class AuthSettings(Section):
    """Who may use the gateway (R18): bearer tokens for callers, agents and admins."""

    mode: Literal["auto", "tokens", "open"] = Field(
        default="auto",
        description="auto: tokens are required as soon as one exists, and until then the "
        "gateway serves only on loopback; tokens: always required; open: never (must be "
        "written explicitly to serve a non-loopback address without tokens).",
    )
    tokens_file: str = Field(
        default=".reach/tokens.json",
        description="Where tokens live with the memory registry (with redis: in Redis). "
        "Relative: to reach.yaml when written there, else to the working directory.",
    )
    resync_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="A full re-read of the token store this often, besides change notices.",
    )


class RuleSettings(Section):
    """One authorization rule, in R19's shape. `*` matches any caller or capability."""

    name: str | None = Field(default=None, max_length=128, description="Named in 403s and audit.")
    caller: str = Field(
        min_length=1, max_length=128, description="The caller the rule is about, or *."
    )
    target_capability: str = Field(
        min_length=1, max_length=64, description="The capability the rule is about, or *."
    )
    allowed_operations: list[str] = Field(
        default_factory=list,
        description="Operations the rule allows; once any rule exists, what no rule allows is "
        "denied.",
    )
    denied_operations: list[str] = Field(
        default_factory=list, description="Operations the rule denies; deny wins over any allow."
    )
    rate_limit_per_minute: float | None = Field(
        default=None,
        ge=0.01,
        le=6_000_000,
        description="A rate limit per caller and capability; past it, 429.",
    )

    @property
    def label(self) -> str:
        return self.name or f"{self.caller}->{self.target_capability}"


class AuditSettings(Section):
    """One redacted JSON record per invoke, Join, eviction, token change, denial (R20)."""

    sink: Literal["file", "stdout", "both", "none"] = Field(
        default="file", description="Where audit records go."
    )
    file: str = Field(
        default=".reach/audit.jsonl",
        description="The audit file (sink: file or both), mode 0600, appended.",
    )
    max_string: int = Field(
        default=256, ge=8, le=1_000_000, description="Longer strings keep {len, sha256} only."
    )
    redact_keys: list[str] = Field(
        default_factory=lambda: list(SECRET_KEY_NAMES),
        description="Values under keys named like these (any depth, any case, also as a suffix) "
        "are written as ***.",
    )
    flush_interval_ms: int = Field(
        default=200,
        ge=1,
        le=60_000,
        description="Records are written and fsync'd once per batch, this often.",
    )


class TlsSettings(Section):
    """mTLS between Reach and agents: Reach presents `cert_file` and verifies each agent's
    certificate against `ca_file`, for the identity spiffe://<trust_domain>/agent/<id>."""

    enabled: bool = Field(
        default=False,
        description="true: Reach presents its certificate to agents and verifies theirs (`reach "
        "certs init`).",
    )
    ca_file: str = Field(
        default=".reach/certs/ca.pem", description="The CA agents' certificates must come from."
    )
    cert_file: str = Field(
        default=".reach/certs/reach.pem",
        description="Reach's own certificate (re-read when it changes).",
    )
    key_file: str = Field(
        default=".reach/certs/reach-key.pem", description="The key of Reach's certificate."
    )
    trust_domain: str = Field(
        default="reach.local",
        pattern=r"^[a-z0-9][a-z0-9.-]{0,252}$",
        description="The SPIFFE trust domain of agent identities: "
        "spiffe://<trust_domain>/agent/<id>.",
    )


class EncryptionSettings(Section):
    """AES-GCM encryption of every payload in workflow history (a Temporal payload codec)."""

    enabled: bool = Field(
        default=False,
        description="true: every payload is AES-256-GCM encrypted before it reaches Temporal.",
    )
    active_key: str | None = Field(default=None, description="The key id new payloads use.")
    keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="key id -> base64 of 32 random bytes; keep old ids to read old requests. "
        'Set through REACH_SECURITY__ENCRYPTION__KEYS=\'{"k1": "..."}\', not in the file.',
    )
    codec_cors_origins: list[str] = Field(
        default_factory=lambda: ["http://localhost:8233", "http://127.0.0.1:8233"],
        description="Browser origins (the Temporal UI) allowed to call /codec/encode and "
        "/codec/decode.",
    )

    @model_validator(mode="after")
    def _active_key_known(self) -> EncryptionSettings:
        if self.enabled and (self.active_key is None or self.active_key not in self.keys):
            raise ValueError("encryption.enabled needs active_key naming one of keys")
        return self

    @model_validator(mode="after")
    def _keys_are_aes256(self) -> EncryptionSettings:
        if not self.keys:
            return self
        for key_id, secret in self.keys.items():
            try:
                decode_key(secret.get_secret_value())
            except ValueError as exc:  # the message names the key id, never its value
                raise ValueError(f"keys.{key_id} {exc}") from None
        return self


class SecuritySettings(Section):
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR) callback URLs and agent addresses may resolve to beyond "
        "global unicast, e.g. 10.0.0.0/8. Empty: global addresses only. Not written: loopback "
        "(127.0.0.0/8, ::1) when the gateway listens on loopback, else global only.",
    )
    tls: TlsSettings = Field(default_factory=TlsSettings)
    encryption: EncryptionSettings = Field(default_factory=EncryptionSettings)
    webhook_key: SecretStr | None = Field(
        default=None,
        description="Master secret for signing callbacks; each caller's secret derives from it "
        "(`reach tokens webhook-secret CALLER`). None: callbacks are sent unsigned.",
    )

    @field_validator("allow_networks")
    @classmethod
    def _networks_are_cidrs(cls, value: list[str]) -> list[str]:
        parse_networks(value)
        return value
