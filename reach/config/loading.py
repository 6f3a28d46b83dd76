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
    env = _reach_env()
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        line = f"  reach.{loc}: {err['msg']}"
        variable = _variable_for(err["loc"], env)
        if variable:
            line += f" (set by the environment variable {variable})"
        lines.append(line)
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def _reach_env() -> dict[str, str]:
    """The REACH_* variables, upper-cased name -> name as set (pydantic reads them so)."""
    return {key.upper(): key for key in os.environ if key.upper().startswith("REACH_")}


def _variable_for(loc: tuple[int | str, ...], env: dict[str, str]) -> str | None:
    """The REACH_* variable that gave the value at `loc`, or gave a section holding it.

    A value set as JSON in a section's variable (REACH_POLICY='{...}') is named by that
    variable; the deepest match wins."""
    parts = [str(p).upper() for p in loc]
    for depth in range(len(parts), 0, -1):
        name = "REACH_" + "__".join(parts[:depth])
        if name in env:
            return env[name]
    return None


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
        settings = ReachSettings(**data)
    except ValidationError as exc:
        source = source_name(file_path)
        raise ConfigError(_format_errors(f"{source} (or REACH_* variables)", exc)) from exc
    env = {key.lower(): value for key, value in os.environ.items()}  # as pydantic reads it
    _check_http_port(settings, data, env, source_name(file_path))
    if file_path is not None:
        _anchor_tokens_file(settings, data, env, file_path)
    return settings


def _check_http_port(
    settings: ReachSettings, data: dict[str, Any], env: dict[str, str], source: str
) -> None:
    """`transport.ports.http` (the seed's schema) must say what `listen_port` says.

    The gateway's HTTP port is `listen_port`; nothing reads `ports.http`, so one that disagrees
    is a port someone expects the gateway on and it is not. Each source is held to its own
    word: a file may not say two ports, and REACH_TRANSPORT__PORTS__HTTP may not differ from
    the port in force. REACH_LISTEN_PORT alone overrides both keys of the file (no error)."""
    env_http = env.get("reach_transport__ports__http")
    if env_http is not None:
        given, key = env_http, "REACH_TRANSPORT__PORTS__HTTP"
    elif "reach_listen_port" in env:
        return  # the environment moved the port; the file's two keys are both overridden
    else:
        transport = data.get("transport")
        ports = transport.get("ports") if isinstance(transport, dict) else None
        if not isinstance(ports, dict) or "http" not in ports:
            return
        given, key = ports["http"], f"transport.ports.http in {source}"
    port = settings.listen_port
    if str(given).strip() == str(port):
        return
    if "reach_listen_port" in env:
        where = f"REACH_LISTEN_PORT={port}"
    elif "listen_port" in data:
        where = f"listen_port: {port} in {source}"
    else:
        where = f"listen_port {port} (its default)"
    raise ConfigError(
        f"{key} says the HTTP port is {given}, but {where}: the gateway listens on "
        "listen_port and nothing reads transport.ports.http. Write the same port in both "
        "(or leave transport.ports.http out)"
    )


def _anchor_tokens_file(
    settings: ReachSettings, data: dict[str, Any], env: dict[str, str], file_path: Path
) -> None:
    """A relative `auth.tokens_file` written in the file is relative to the file (so the CLI
    run from any directory and the gateway read the same tokens); one given in the
    environment, or the default, stays relative to the working directory."""
    auth = data.get("auth")
    if not isinstance(auth, dict) or "tokens_file" not in auth:
        return
    if "reach_auth__tokens_file" in env or "reach_auth" in env:
        return
    tokens = Path(settings.auth.tokens_file)
    if not tokens.is_absolute():
        settings.auth.tokens_file = os.path.abspath(file_path.parent / tokens)
