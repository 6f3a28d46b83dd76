"""Reading `reach.yaml` and the environment into `ReachSettings`, with errors that name the
file and the field. Checks that need this process's plug-ins are in `reach.settings_checks`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from reach.config.base import ConfigError
from reach.config.settings import ReachSettings

DEFAULT_CONFIG_FILE = "reach.yaml"
CONFIG_ENV_VAR = "REACH_CONFIG"


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  reach.{loc}: {err['msg']}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) != {"reach"} or not isinstance(raw["reach"], dict):
        raise ConfigError(f"{path}: expected one top-level mapping 'reach:' (see R7)")
    return dict(raw["reach"])


def config_file(path: str | Path | None = None) -> Path | None:
    """The configuration file in use: `path`, or $REACH_CONFIG, or ./reach.yaml if present."""
    chosen = path or os.environ.get(CONFIG_ENV_VAR)
    if chosen:
        file_path = Path(chosen)
        if not file_path.is_file():
            raise ConfigError(f"configuration file {file_path} does not exist")
        return file_path
    if Path(DEFAULT_CONFIG_FILE).is_file():
        return Path(DEFAULT_CONFIG_FILE)
    return None


def source_name(file_path: Path | None) -> str:
    """How an error names where the settings came from."""
    return str(file_path) if file_path else "environment/defaults"


def load_settings(path: str | Path | None = None, **overrides: Any) -> ReachSettings:
    """Load settings from `path` (or $REACH_CONFIG, or ./reach.yaml if present) and the env.

    The model's own checks only: what needs this process's plug-ins (routing strategies) is
    checked by `reach.settings_checks.load_checked_settings`, which start-up uses."""
    file_path = config_file(path)
    data = read_yaml(file_path) if file_path else {}
    data.update(overrides)
    try:
        return ReachSettings(**data)
    except ValidationError as exc:
        source = source_name(file_path)
        raise ConfigError(_format_errors(f"{source} (or REACH_* variables)", exc)) from exc
