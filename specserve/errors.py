"""The error hierarchy of the specserve core.

Core code raises these and nothing else for expected failures; each service maps them to gRPC
status codes in one table (services/*/servicer.py). The core never imports grpc.
"""


class SpecServeError(Exception):
    """Base of every expected specserve failure."""


class InvalidRequest(SpecServeError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling params, token out of vocabulary…).
    `param`: the request field at fault, when it is one (a SamplingParams field name)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityExhausted(SpecServeError):
    """Not enough KV pages (or another resource) to admit or continue the request."""


class RequestAborted(SpecServeError):
    """The request was cancelled by its client or by shutdown."""


class ModelError(SpecServeError):
    """A checkpoint is unsupported, missing tensors, or has tensors of the wrong shape."""
