"""The core's error hierarchy → gRPC status codes. Each servicer maps through `status_for`.

DEADLINE_SLACK_S: a call cancelled this close to its deadline counts as DEADLINE_EXCEEDED (the
caller's own deadline fires a transit time before the server's, which counts from arrival).
"""

from __future__ import annotations

import grpc

from specserve.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    InvalidRequest,
    ModelError,
    RequestAborted,
    SpecServeError,
)

DEADLINE_SLACK_S = 0.05

STATUS_FOR: dict[type[SpecServeError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.CANCELLED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    ModelError: grpc.StatusCode.INTERNAL,
}


def ended_code(code: grpc.StatusCode, time_left: float | None) -> grpc.StatusCode:
    """A call's status as counted: CANCELLED within DEADLINE_SLACK_S of its deadline
    (`time_left`: seconds to it; None: no deadline) is DEADLINE_EXCEEDED."""
    if code is grpc.StatusCode.CANCELLED and time_left is not None \
            and time_left <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return code


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code of a core error (INTERNAL for anything unexpected)."""
    for cls in type(error).__mro__:
        if cls in STATUS_FOR:
            return STATUS_FOR[cls]
    return grpc.StatusCode.INTERNAL
