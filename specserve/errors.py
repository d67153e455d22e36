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


class DeadlineExceeded(SpecServeError):
    """The request's deadline passed before it could finish."""


class ModelError(SpecServeError):
    """A checkpoint is unsupported, missing tensors, or has tensors of the wrong shape."""


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raise InvalidRequest unless a prompt of `prompt_tokens` and up to `max_tokens` more fit a
    context of `max_model_len` tokens; the message names the prompt when it alone leaves no
    room, else max_tokens (what to lower)."""
    if prompt_tokens >= max_model_len:
        raise InvalidRequest(f"prompt has {prompt_tokens} tokens; the model's context is "
                             f"{max_model_len} tokens, one at least left for the output")
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequest(f"prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}; "
                             f"the model's context is {max_model_len} tokens")
