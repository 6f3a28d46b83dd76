from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class InvokeRequest(_message.Message):
    __slots__ = ("operation", "payload")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    operation: str
    payload: bytes
    def __init__(self, operation: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class InvokeReply(_message.Message):
    __slots__ = ("accepted", "result")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    result: bytes
    def __init__(self, accepted: _Optional[bool] = ..., result: _Optional[bytes] = ...) -> None: ...
