"""The timeline of one request (R16): what happened to it, in order, with offsets from acceptance.

Built from the request's workflow history (and its callback delivery's), handed over as plain
`HistoryEvent`s whose payloads are already decoded — the Temporal side (`gateway_api.timeline`)
reads and decodes them; this module only reads the story in them:

    +0 ms      accepted          from orchestrator: knowledge-retriever.query, deadline +3000 ms
    +1 ms      instance_chosen   retriever-03 via grpc (least_request)
    +1 ms      sent              attempt 1 sent to retriever-03 via grpc
    +3001 ms   timeout           no answer within timeout_ms=3000

Times come from three clocks: the gateway's (acceptance), the worker's (when a local activity
was scheduled) and the Temporal server's (every event). Offsets are kept in the history's order
and never go backwards, so a small skew between machines cannot reorder the story.

Event kinds: accepted, instance_chosen, routing_failed, sent, waiting_for_worker,
attempt_succeeded, attempt_accepted, attempt_failed, rerouted, backoff, redeliver, store_wait,
wait, in_flight, rate_limited, token, idempotency, released, late_answer, result, timeout, ended,
callback, callback_retrying, callback_pending, callback_delivered, callback_given_up; and
progress and log (an agent's own reports while a call ran: `reach.progress`, merged by
`with_progress` and `with_logs`).
"""

from __future__ import annotations

from reach.timeline._invoke import InvokeStory
from reach.timeline._model import (
    LOCAL_ACTIVITY_MARKER,
    PENDING_ACTIVITY,
    HistoryEvent,
    Timeline,
    TimelineEvent,
    error_of,
    failure_dict,
)
from reach.timeline._progress import with_logs, with_progress

__all__ = [
    "LOCAL_ACTIVITY_MARKER",
    "PENDING_ACTIVITY",
    "HistoryEvent",
    "Timeline",
    "TimelineEvent",
    "build_timeline",
    "error_of",
    "failure_dict",
    "with_logs",
    "with_progress",
]


def build_timeline(
    request_id: str,
    history: list[HistoryEvent],
    delivery: list[HistoryEvent] | None = None,
) -> Timeline:
    """The timeline of a request from its invoke workflow's history and, when it has a
    callback, its delivery workflow's history."""
    story = InvokeStory(request_id)
    story.read_invoke(history)
    story.read_delivery(delivery or [])
    return story.timeline()
