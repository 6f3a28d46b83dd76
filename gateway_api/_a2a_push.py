"""The A2A front's push notification configs: a request has at most one, its callback, fixed
when it starts (SendMessage's `configuration.taskPushNotificationConfig`), delivered as
Reach's signed callbacks are (docs/a2a-front.md)."""

from __future__ import annotations

from typing import Any

from a2a.types import (
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import TaskNotFoundError, UnsupportedOperationError
from google.protobuf import json_format

from gateway_api._a2a_calls import Call
from gateway_api._a2a_tasks import a2a_error

# The one push notification config a request can have: its callback.
CONFIG_ID = "callback"


async def _callback(call: Call, task_id: str) -> TaskPushNotificationConfig | None:
    """The request's callback as a config (its URL as `safe_url` shows it), or None."""
    rid = call.task_id_of(task_id)
    delivery = (await call.gateway.requests.status(rid, call.reader())).delivery
    if delivery is None:
        return None
    return TaskPushNotificationConfig(id=CONFIG_ID, task_id=rid, url=delivery.url)


async def set_push(call: Call, params: TaskPushNotificationConfig) -> dict[str, Any]:
    config = await _callback(call, params.task_id)
    if config is not None and config.url == params.url:
        return json_format.MessageToDict(config)
    raise a2a_error(
        UnsupportedOperationError,
        "a request's callback is fixed when it starts: set "
        "configuration.taskPushNotificationConfig in SendMessage",
    )


async def get_push(call: Call, params: GetTaskPushNotificationConfigRequest) -> dict[str, Any]:
    config = await _callback(call, params.task_id)
    if config is None or params.id not in ("", CONFIG_ID):
        raise a2a_error(
            TaskNotFoundError, f"task {params.task_id} has no push config {params.id!r}"
        )
    return json_format.MessageToDict(config)


async def list_push(call: Call, params: ListTaskPushNotificationConfigsRequest) -> dict[str, Any]:
    config = await _callback(call, params.task_id)
    answer = ListTaskPushNotificationConfigsResponse(configs=[config] if config else [])
    return json_format.MessageToDict(answer, always_print_fields_with_no_presence=True)


async def delete_push(
    call: Call, params: DeleteTaskPushNotificationConfigRequest
) -> dict[str, Any]:
    config = await _callback(call, params.task_id)
    if config is not None and params.id in ("", CONFIG_ID):
        raise a2a_error(
            UnsupportedOperationError, "a request's callback cannot be removed once it started"
        )
    return {}
