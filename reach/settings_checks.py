"""Settings checked for use: the model's own validation (`reach.config`) and then what only
this process can tell, the installed plug-ins (every routing strategy named exists and accepts
its settings).

Kept apart from `reach.config` so that the settings model, which every layer imports, imports
none of the layers built on it. Start-up uses `load_checked_settings`: `reach config check`, the
CLI before it starts a gateway or worker, `worker.py`, and the gateway's configuration reload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reach.config import ConfigError, ReachSettings, config_file, load_settings, source_name
from reach.routing import check_routing


def check_settings(settings: ReachSettings, source: str) -> None:
    """Raise ConfigError, naming `source` and the field, if a plug-in check fails."""
    try:
        check_routing(settings)
    except ConfigError as exc:
        raise ConfigError(f"invalid configuration in {source}: {exc}") from exc


def load_checked_settings(path: str | Path | None = None, **overrides: Any) -> ReachSettings:
    """`reach.config.load_settings`, then `check_settings`: what start-up loads."""
    file_path = config_file(path)
    settings = load_settings(file_path, **overrides)
    check_settings(settings, source_name(file_path))
    return settings


__all__ = ["check_settings", "load_checked_settings"]
