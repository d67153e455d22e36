"""The error hierarchy of the specserve core, and the request checks the engine and the services
share (a request id, prompt ids, the context).

Core code raises these and nothing else for expected failures; each service maps them to gRPC
status codes in one table (services/*/servicer.py). The core never imports grpc.
"""

import operator


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


# how a context-length error begins (OpenAI's and vLLM's words, which client libraries match)
CONTEXT_EXCEEDED = "This model's maximum context length is"


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raise InvalidRequest unless a prompt of `prompt_tokens` and up to `max_tokens` more fit a
    context of `max_model_len` tokens; the message names the prompt when it alone leaves no
    room, else max_tokens (what to lower)."""
    if prompt_tokens >= max_model_len:
        raise InvalidRequest(f"{CONTEXT_EXCEEDED} {max_model_len} tokens. However, the prompt "
                             f"has {prompt_tokens} tokens, and one at least must be left for "
                             "the output. Please reduce the length of the prompt.")
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequest(f"{CONTEXT_EXCEEDED} {max_model_len} tokens. However, you "
                             f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                             f"in the prompt, {max_tokens} in max_tokens). Please reduce the "
                             "length of the prompt or max_tokens.")


# a request id travels in every drafter message of its request: bounded, as vLLM's and
# OpenAI's ids are short
MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id) -> str:
    """`request_id`, or InvalidRequest unless it is a non-empty str of at most
    MAX_REQUEST_ID_CHARS characters."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest(f"request id must be a non-empty string, got {request_id!r:.40}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request id of {len(request_id)} characters; at most "
                             f"{MAX_REQUEST_ID_CHARS} are allowed")
    return request_id


def integer_ids(ids) -> list[int]:
    """`ids` as a list of Python ints (numpy / torch integer scalars too); InvalidRequest for
    anything else (a float, a bool, a string), never a silent truncation."""
    ids = list(ids)
    if set(map(type, ids)) <= {int}:
        return ids
    try:
        if not any(isinstance(t, bool) for t in ids):
            return [operator.index(t) for t in ids]
    except TypeError:
        pass
    bad = next(t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__"))
    raise InvalidRequest(f"prompt token ids must be integers, got {bad!r:.40}", "prompt")
