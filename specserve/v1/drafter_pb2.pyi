from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftBatch(_message.Message):
    __slots__ = ("step_id", "entries")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    entries: _containers.RepeatedCompositeFieldContainer[DraftEntry]
    def __init__(self, step_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[DraftEntry, _Mapping]]] = ...) -> None: ...

class DraftEntry(_message.Message):
    __slots__ = ("request_id", "drafter", "bonus_token", "start", "budget", "max_depth", "context", "new_history", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NEW_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drafter: _common_pb2.DrafterKind
    bonus_token: int
    start: int
    budget: int
    max_depth: int
    context: _common_pb2.Tensor
    new_history: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., drafter: _Optional[_Union[_common_pb2.DrafterKind, str]] = ..., bonus_token: _Optional[int] = ..., start: _Optional[int] = ..., budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., context: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., new_history: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TreeBatch(_message.Message):
    __slots__ = ("step_id", "trees", "forward_s", "tree_build_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TREE_BUILD_S_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    trees: _containers.RepeatedCompositeFieldContainer[Tree]
    forward_s: float
    tree_build_s: float
    def __init__(self, step_id: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ..., forward_s: _Optional[float] = ..., tree_build_s: _Optional[float] = ...) -> None: ...

class Tree(_message.Message):
    __slots__ = ("request_id", "token_ids", "parents", "depths", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
