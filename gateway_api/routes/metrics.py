"""GET /metrics: this gateway process's Prometheus metrics (`reach.telemetry.metrics`).

Open like the probes while no token is required (a gateway without tokens serves loopback
only); once tokens are required it needs one, of any kind, which Prometheus sends with
`authorization: {type: Bearer, credentials_file: ...}` in its scrape config. Either way, keep
the port on an internal network: the metrics name capabilities and instances.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gateway_api.deps import GatewayDep, ReaderDep
from reach.errors import NotFound
from reach.messages import ErrorResponse
from reach.telemetry.metrics import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get(
    "/metrics",
    summary="Prometheus metrics of this gateway process (text exposition format 0.0.4)",
    response_class=Response,
    responses={
        200: {
            "description": "The metrics: invokes, latencies, agent calls, retries, heartbeats, "
            "evictions, connections, in-flight calls, breakers, ejections, rate limits",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        401: {
            "model": ErrorResponse,
            "description": "Missing, invalid, expired or revoked token (when tokens are required)",
        },
    },
)
async def metrics(gateway: GatewayDep, _reader: ReaderDep) -> Response:
    if gateway.metrics is None:  # not routed then (metrics.enabled: false)
        raise NotFound("metrics are off (metrics.enabled: false)")
    return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)
