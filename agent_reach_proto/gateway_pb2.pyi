from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InvokeRequest(_message.Message):
    __slots__ = ("request_id", "target", "operation", "payload_json", "timeout_ms", "callback", "idempotency_key", "routing_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: str
    operation: str
    payload_json: str
    timeout_ms: int
    callback: str
    idempotency_key: str
    routing_key: str
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[str] = ..., operation: _Optional[str] = ..., payload_json: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., callback: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., routing_key: _Optional[str] = ...) -> None: ...

class InvokeResponse(_message.Message):
    __slots__ = ("request_id", "status", "duration_ms", "result_json", "instance_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: str
    duration_ms: int
    result_json: str
    instance_id: str
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[str] = ..., duration_ms: _Optional[int] = ..., result_json: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("capability", "instance_id", "protocol", "service_address", "heartbeat_interval", "operations", "max_message_bytes", "async_callback", "labels", "declared_operations", "weight", "max_inflight")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ASYNC_CALLBACK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    capability: str
    instance_id: str
    protocol: str
    service_address: str
    heartbeat_interval: float
    operations: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    async_callback: bool
    labels: _containers.ScalarMap[str, str]
    declared_operations: _containers.RepeatedCompositeFieldContainer[OperationDeclaration]
    weight: int
    max_inflight: int
    def __init__(self, capability: _Optional[str] = ..., instance_id: _Optional[str] = ..., protocol: _Optional[str] = ..., service_address: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., operations: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., async_callback: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ..., declared_operations: _Optional[_Iterable[_Union[OperationDeclaration, _Mapping]]] = ..., weight: _Optional[int] = ..., max_inflight: _Optional[int] = ...) -> None: ...

class OperationDeclaration(_message.Message):
    __slots__ = ("name", "idempotent", "timeout_ms", "description", "input_schema_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    idempotent: bool
    timeout_ms: int
    description: str
    input_schema_json: str
    def __init__(self, name: _Optional[str] = ..., idempotent: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ...) -> None: ...

class JoinAck(_message.Message):
    __slots__ = ("instance_id", "capability", "heartbeat_interval", "heartbeat_timeout", "max_message_bytes", "async_callback", "session")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ASYNC_CALLBACK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    capability: str
    heartbeat_interval: float
    heartbeat_timeout: float
    max_message_bytes: int
    async_callback: bool
    session: str
    def __init__(self, instance_id: _Optional[str] = ..., capability: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., heartbeat_timeout: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., async_callback: _Optional[bool] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "status", "checks_json", "inflight", "session", "batch")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_JSON_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    status: str
    checks_json: str
    inflight: int
    session: str
    batch: _containers.RepeatedCompositeFieldContainer[HeartbeatRequest]
    def __init__(self, instance_id: _Optional[str] = ..., status: _Optional[str] = ..., checks_json: _Optional[str] = ..., inflight: _Optional[int] = ..., session: _Optional[str] = ..., batch: _Optional[_Iterable[_Union[HeartbeatRequest, _Mapping]]] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("instance_id", "error_type", "message", "status", "heartbeat_interval", "batch")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    error_type: str
    message: str
    status: str
    heartbeat_interval: float
    batch: _containers.RepeatedCompositeFieldContainer[HeartbeatAck]
    def __init__(self, instance_id: _Optional[str] = ..., error_type: _Optional[str] = ..., message: _Optional[str] = ..., status: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., batch: _Optional[_Iterable[_Union[HeartbeatAck, _Mapping]]] = ...) -> None: ...
