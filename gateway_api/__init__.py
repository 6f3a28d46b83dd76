"""The gateway: a thin FastAPI front over the core, Temporal and the registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway_api.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: `python -m gateway_api tokens ...` should not load the whole app.
    if name == "create_app":
        from gateway_api.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
