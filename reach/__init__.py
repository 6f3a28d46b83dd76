"""Agent-Reach core: configuration, the standard message, errors, registry, routing, policy.

Nothing in this package imports FastAPI, Temporal or a protocol library; the outer packages
(`gateway_api`, `workflows`, `activities`, `connectors`, `agent_reach_sdk`) import it.
"""

__version__ = "0.1.0"
