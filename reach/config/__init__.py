"""One validated settings model for `reach.yaml` plus `REACH_…` environment overrides (R7, R26).

Precedence, highest first: explicit keyword arguments, `REACH_…` environment variables (nested
fields with `__`, e.g. `REACH_REGISTRY__TYPE=redis`), the YAML file, the defaults. The
Temporal connection also honours the standard `TEMPORAL_ADDRESS`, `TEMPORAL_NAMESPACE`,
`TEMPORAL_API_KEY` and `TEMPORAL_TLS_*` variables (applied where the client connects).

A wrong field fails at start-up with a message that names the file and the field.

One module per role, every public name re-exported here (`from reach.config import X`):
`base` (the error, the section base), `connections` (registry, transport, callbacks, Temporal),
`policy`, `routing`, `security`, `agents` (instances registered by URL), `observability`
(telemetry, metrics), `settings` (the whole `reach:` mapping) and `loading` (file and
environment). This package imports no other part of
Reach above `reach.invocation`, `reach.limits` and `reach.messages`; checks that need plug-ins
live in `reach.settings_checks`.
"""

from reach.config.agents import UrlAgentOperation, UrlAgentSettings
from reach.config.base import DAY_MS, ConfigError
from reach.config.connections import (
    CallbackSettings,
    DevServerSettings,
    RegistrySettings,
    TemporalSettings,
    TransportSettings,
)
from reach.config.loading import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_FILE,
    config_file,
    load_settings,
    read_yaml,
    source_name,
)
from reach.config.observability import MetricsSettings, TelemetrySettings
from reach.config.policy import (
    CapabilityPolicySettings,
    CircuitBreakerSettings,
    LimitSettings,
    OperationSettings,
    OutlierSettings,
    PolicySettings,
    RateLimitSettings,
    RetrySettings,
)
from reach.config.routing import (
    HASH_ON_PATTERN,
    CapabilitySettings,
    RoutingDefaults,
    RoutingSettings,
)
from reach.config.security import (
    SECRET_KEY_NAMES,
    AuditSettings,
    AuthSettings,
    EncryptionSettings,
    RuleSettings,
    SecuritySettings,
    TlsSettings,
)
from reach.config.settings import ReachSettings

__all__ = [
    "CONFIG_ENV_VAR",
    "DAY_MS",
    "DEFAULT_CONFIG_FILE",
    "HASH_ON_PATTERN",
    "SECRET_KEY_NAMES",
    "AuditSettings",
    "AuthSettings",
    "CallbackSettings",
    "CapabilityPolicySettings",
    "CapabilitySettings",
    "CircuitBreakerSettings",
    "ConfigError",
    "DevServerSettings",
    "EncryptionSettings",
    "LimitSettings",
    "MetricsSettings",
    "OperationSettings",
    "OutlierSettings",
    "PolicySettings",
    "RateLimitSettings",
    "ReachSettings",
    "RegistrySettings",
    "RetrySettings",
    "RoutingDefaults",
    "RoutingSettings",
    "RuleSettings",
    "SecuritySettings",
    "TelemetrySettings",
    "TemporalSettings",
    "TlsSettings",
    "TransportSettings",
    "UrlAgentOperation",
    "UrlAgentSettings",
    "config_file",
    "load_settings",
    "read_yaml",
    "source_name",
]
