"""The gateway: a thin FastAPI front over the core, Temporal and the registry."""

from gateway_api.app import create_app

__all__ = ["create_app"]
