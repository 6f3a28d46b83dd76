"""Agent-Reach core: configuration, the standard message, errors, registry, routing, policy.

Nothing in this package imports FastAPI, Temporal or a protocol library; the outer packages
(`gateway_api`, `workflows`, `activities`, `connectors`, `agent_reach_sdk`) import it.

Rn (R1 to R26) in comments and docstrings here and in every package refers to the numbered
requirements in docs/requirements.md.
"""

__version__ = "0.1.0"
