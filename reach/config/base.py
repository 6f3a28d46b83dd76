"""What every settings section shares: the error a wrong field raises, and the section base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DAY_MS = 86_400_000


class ConfigError(Exception):
    """The configuration is invalid; the message names the source and the field."""


class Section(BaseModel):
    # Every number finite: `.inf` in a timeout would pass `gt=0` and break every request.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
