from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftBatch(_message.Message):
    __slots__ = ("step_id", "entries", "release")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    entries: _containers.RepeatedCompositeFieldContainer[DraftEntry]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[DraftEntry, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftEntry(_message.Message):
    __slots__ = ("request_id", "drafter", "bonus_token", "start", "budget", "max_depth", "context", "new_history", "trace_context", "context_ref", "context_fused", "chain")
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
    CONTEXT_REF_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FUSED_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drafter: _common_pb2.DrafterKind
    bonus_token: int
    start: int
    budget: int
    max_depth: int
    context: _common_pb2.Tensor
    new_history: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    context_ref: ContextRef
    context_fused: bool
    chain: bool
    def __init__(self, request_id: _Optional[str] = ..., drafter: _Optional[_Union[_common_pb2.DrafterKind, str]] = ..., bonus_token: _Optional[int] = ..., start: _Optional[int] = ..., budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., context: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., new_history: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., context_ref: _Optional[_Union[ContextRef, _Mapping]] = ..., context_fused: _Optional[bool] = ..., chain: _Optional[bool] = ...) -> None: ...

class ContextRef(_message.Message):
    __slots__ = ("generation", "offset", "rows")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    offset: int
    rows: int
    def __init__(self, generation: _Optional[int] = ..., offset: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("request_id", "token_ids", "parents", "depths", "error", "scores")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    error: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RingSpec(_message.Message):
    __slots__ = ("generation", "rows", "width", "dtype", "nonce", "shm_path", "cuda")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rows: int
    width: int
    dtype: str
    nonce: bytes
    shm_path: str
    cuda: CudaIpc
    def __init__(self, generation: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., nonce: _Optional[bytes] = ..., shm_path: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpc, _Mapping]] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: RingSpec
    def __init__(self, ring: _Optional[_Union[RingSpec, _Mapping]] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("ring_attached", "ring_error", "lane_path", "lane_token", "max_message_bytes")
    RING_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    RING_ERROR_FIELD_NUMBER: _ClassVar[int]
    LANE_PATH_FIELD_NUMBER: _ClassVar[int]
    LANE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ring_attached: bool
    ring_error: str
    lane_path: str
    lane_token: bytes
    max_message_bytes: int
    def __init__(self, ring_attached: _Optional[bool] = ..., ring_error: _Optional[str] = ..., lane_path: _Optional[str] = ..., lane_token: _Optional[bytes] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
