"""OpenAI error objects for the HTTP API: `ApiError` (HTTP status, OpenAI error type, message,
the body field at fault) and how a gRPC status and a core error become one. A 400's `param`
names the field as the body calls it (chat's `messages`, `max_completion_tokens`), whether the
check that failed ran while parsing, in SamplingParams, in the pipeline or at the verifier (its
message crosses the wire as text: the field it names is the param).
"""

from __future__ import annotations

import re

import grpc

from specserve.errors import CONTEXT_EXCEEDED, InvalidRequest

# HTTP status and OpenAI error type per gRPC code (anything else: 500)
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
               grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
               grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
               grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_overloaded"),
               grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
               grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
               grpc.StatusCode.CANCELLED: (499, "cancelled")}
# the request fields an error message can name (the first it names is the error's param, but
# max_tokens wins: "… (N in the prompt, M in max_tokens)" is fixed by lowering it)
_FIELD_WORD = re.compile(r"\b(max_tokens|temperature|top_k|top_p|seed|stop_token_ids|stop|"
                         r"budget|drafter|prompt_logprobs|logprobs|prompt|messages|token ids?)\b")


class ApiError(Exception):
    """An HTTP error to answer with: status, OpenAI error type, message, the offending param."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def __reduce__(self):  # raised in the prompt worker process, it crosses back whole
        return ApiError, (self.status, self.message, self.type, self.param, self.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def of_grpc(cls, code: grpc.StatusCode, message: str,
                names: dict[str, str] | None = None) -> ApiError:
        """A failed generation's error; a 400's param: the field its message names."""
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        if status != 400:
            return cls(status, message, type_, None, code.name.lower())
        names = names or {}
        return cls(status, _worded(message, names), type_, named_field(message, names),
                   _code(message) or code.name.lower())


def named_field(message: str, names: dict[str, str]) -> str | None:
    """The body field an error message is about: max_tokens if it names it, else the first
    request field it names, if any."""
    words = [m.group(1) for m in _FIELD_WORD.finditer(message)]
    if not words:
        return None
    name = "max_tokens" if "max_tokens" in words else words[0]
    name = "prompt" if name.startswith("token id") else name
    return names.get(name, name)


def invalid(e: InvalidRequest, names: dict[str, str]) -> ApiError:
    """The 400 for a request the core refused, naming its field (`InvalidRequest.param`, else
    the first the message names) as the body does — in the message too."""
    message, name = str(e), getattr(e, "param", None)
    if name is None:
        return ApiError(400, _worded(message, names), param=named_field(message, names),
                        code=_code(message))
    param = names.get(name, name)
    if message.startswith(f"{name} "):
        message = param + message[len(name):]
    return ApiError(400, message, param=param)


def _code(message: str) -> str | None:
    """OpenAI's error code for a context-length error (what client libraries look for)."""
    return "context_length_exceeded" if message.startswith(CONTEXT_EXCEEDED) else None


def _worded(message: str, names: dict[str, str]) -> str:
    """`message` with max_tokens called as the body calls it (chat's max_completion_tokens)."""
    name = names.get("max_tokens", "max_tokens")
    return message if name == "max_tokens" else re.sub(r"\bmax_tokens\b", name, message)

