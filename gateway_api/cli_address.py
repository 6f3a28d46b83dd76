"""Which gateway the CLI's API commands talk to when `--gateway` is not given: the configured
one (`ReachSettings.gateway_url`), read without loading the settings model.

Validating the whole `reach.yaml` with pydantic took about a second before `reach agents` or
`reach trace` could send a request (issue 26). These commands use three fields of it —
`public_url`, `listen_host`, `listen_port` — so only those are read here, from the file and the
`REACH_*` variables, with the settings model's precedence (environment over file) and its
`gateway_url` rule. Whenever they are not plainly valid (the file is missing, is not YAML, has
no `reach:` mapping, or one of them has the wrong type), the settings model is loaded after
all, so the error is the one it always was, word for word. The rest of the file is not checked
by these commands (`reach config check` and every gateway still do).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

CONFIG_ENV_VAR = "REACH_CONFIG"  # reach.config.CONFIG_ENV_VAR (tests/unit/test_cli_start.py)
DEFAULT_CONFIG_FILE = "reach.yaml"  # reach.config.DEFAULT_CONFIG_FILE
_PORT = re.compile(r"^[0-9]{1,5}$")
# The settings' fields this module reads: the name in the file, and REACH_<NAME> in the env.
FIELDS = ("public_url", "listen_host", "listen_port")


class _NotPlain(Exception):
    """Something only the settings model can judge: load it (it names the error)."""


def configured_gateway_url(config: str | None = None) -> str:
    """`ReachSettings.gateway_url` of the configuration `config` (or $REACH_CONFIG, or
    ./reach.yaml if present) and the environment. Raises ConfigError as loading would."""
    try:
        return _plain_gateway_url(config)
    except _NotPlain:
        from reach.settings_checks import load_checked_settings

        return load_checked_settings(config).gateway_url


def _plain_gateway_url(config: str | None) -> str:
    values = _from_file(config)
    # As pydantic-settings reads the environment (case_sensitive off): names lowercased.
    env = {key.lower(): value for key, value in os.environ.items()}
    for field in FIELDS:
        if f"reach_{field}" in env:
            values[field] = env[f"reach_{field}"]
    public_url = values.get("public_url")
    host = values.get("listen_host", "127.0.0.1")
    port = values.get("listen_port", 7600)
    if public_url is not None and not isinstance(public_url, str):
        raise _NotPlain
    if not isinstance(host, str):
        raise _NotPlain
    if isinstance(port, str) and _PORT.match(port):
        port = int(port)
    if type(port) is not int or not 1 <= port <= 65535:
        raise _NotPlain
    if public_url:
        return public_url.rstrip("/")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{port}"


def _from_file(config: str | None) -> dict[str, Any]:
    """The fields of FIELDS the file sets (`reach.config.config_file`, `read_yaml`)."""
    chosen = config or os.environ.get(CONFIG_ENV_VAR)
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            raise _NotPlain
    elif Path(DEFAULT_CONFIG_FILE).is_file():
        path = Path(DEFAULT_CONFIG_FILE)
    else:
        return {}
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        raise _NotPlain from None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) != {"reach"} or not isinstance(raw["reach"], dict):
        raise _NotPlain
    return {field: raw["reach"][field] for field in FIELDS if field in raw["reach"]}
