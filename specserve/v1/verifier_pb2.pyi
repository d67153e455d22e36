from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "spec")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    spec: _common_pb2.SpecOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., spec: _Optional[_Union[_common_pb2.SpecOptions, _Mapping]] = ...) -> None: ...

class VerifyEvent(_message.Message):
    __slots__ = ("token_ids", "commit_len", "accepted_depth", "tree_size", "budget", "fallback", "final", "shape", "why", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    commit_len: int
    accepted_depth: int
    tree_size: int
    budget: int
    fallback: str
    final: VerifyFinal
    shape: str
    why: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., commit_len: _Optional[int] = ..., accepted_depth: _Optional[int] = ..., tree_size: _Optional[int] = ..., budget: _Optional[int] = ..., fallback: _Optional[str] = ..., final: _Optional[_Union[VerifyFinal, _Mapping]] = ..., shape: _Optional[str] = ..., why: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    stats: _common_pb2.SpecStats
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class StopReply(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("kv_pages_used", "kv_pages_free", "kv_pages_total", "active_requests", "waiting_requests", "drafter_connected", "fallbacks", "steps", "drafter_transport", "context_rows", "profile", "kv_pages_reserved", "preempted", "cost_ms", "max_model_len")
    class FallbacksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ContextRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ProfileEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CostMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ROWS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    kv_pages_used: int
    kv_pages_free: int
    kv_pages_total: int
    active_requests: int
    waiting_requests: int
    drafter_connected: bool
    fallbacks: _containers.ScalarMap[str, int]
    steps: int
    drafter_transport: str
    context_rows: _containers.ScalarMap[str, int]
    profile: _containers.ScalarMap[str, float]
    kv_pages_reserved: int
    preempted: int
    cost_ms: _containers.ScalarMap[str, float]
    max_model_len: int
    def __init__(self, kv_pages_used: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., drafter_connected: _Optional[bool] = ..., fallbacks: _Optional[_Mapping[str, int]] = ..., steps: _Optional[int] = ..., drafter_transport: _Optional[str] = ..., context_rows: _Optional[_Mapping[str, int]] = ..., profile: _Optional[_Mapping[str, float]] = ..., kv_pages_reserved: _Optional[int] = ..., preempted: _Optional[int] = ..., cost_ms: _Optional[_Mapping[str, float]] = ..., max_model_len: _Optional[int] = ...) -> None: ...
