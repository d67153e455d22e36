"""OpenAI API request bodies → the gateway's types, and OpenAI error objects.

Requests (`/v1/completions`, `/v1/chat/completions`) → `ApiRequest` (a validated
`GatewayRequest` plus streaming options), refusing what specserve does not implement with a
clear 400 rather than ignoring it; errors as OpenAI error objects (`ApiError`). The responses
are built in services/gateway/openai_responses.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc

from services.common.convert import DRAFTER_NAMES
from services.gateway.convert import GatewayRequest, checked_budget
from specserve.chat_template import ChatTemplate, normalize_messages
from specserve.errors import InvalidRequest
from specserve.types import SamplingParams

DRAFTERS = sorted(n for n in DRAFTER_NAMES.values() if n is not None)  # dflash, ngram, none
# set to anything but these values, a parameter is refused (400): specserve does not do it
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "response_format": (None, {"type": "text"}), "n": (None, 1)}
# HTTP status and OpenAI error type per gRPC code (anything else: 500)
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
               grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
               grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
               grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_overloaded"),
               grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
               grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
               grpc.StatusCode.CANCELLED: (499, "cancelled")}


class ApiError(Exception):
    """An HTTP error to answer with: status, OpenAI error type, message, the offending param."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def of_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        return cls(status, message, type_, code=code.name.lower())


@dataclass(frozen=True)
class ApiRequest:
    request: GatewayRequest
    chat: bool
    stream: bool
    include_usage: bool
    id: str  # "cmpl-…" / "chatcmpl-…"
    created: int


def parse(body, chat: bool, model: str, template: ChatTemplate | None,
          defaults=None) -> ApiRequest:
    """A request body → ApiRequest. Raises ApiError (400; 404 for another model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return _parse(body, chat, model, template, defaults)
    except InvalidRequest as e:
        raise ApiError(400, str(e)) from None


def _parse(body: dict, chat: bool, model: str, template, defaults) -> ApiRequest:
    if body.get("model") not in (None, model):
        raise ApiError(404, f"model {str(body['model'])[:100]!r} is not served here; "
                       f"this gateway serves {model!r}", "not_found_error", "model",
                       "model_not_found")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"{name}={str(body[name])[:60]} is not supported by specserve "
                           f"(leave it unset)", param=name)
    prompt = _chat_prompt(body, template) if chat else _completion_prompt(body.get("prompt"))
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "stream_options needs stream: true and is an object",
                       param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    rid = uuid.uuid4().hex
    request = GatewayRequest(
        rid, prompt if isinstance(prompt, str) else None,
        tuple(prompt) if isinstance(prompt, list) else None, _sampling_params(body, chat,
                                                                               defaults),
        _drafter(body), _budget(body))
    return ApiRequest(request, chat, stream, include_usage,
                      f"{'chatcmpl' if chat else 'cmpl'}-{rid}", int(time.time()))


def _typed(body: dict, name: str, kind, default):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float:  # an int is a float here; a bool is never a number
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise ApiError(400, f"{name} must be {kind.__name__}, got {str(value)[:60]!r}",
                       param=name)
    return value


def _completion_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "prompt must be a non-empty string or token-id list (one prompt per "
                   "request)", param="prompt")


def _chat_prompt(body: dict, template: ChatTemplate | None) -> str:
    if template is None:
        raise ApiError(400, "this model has no chat template (tokenizer_config.json "
                       "chat_template); use /v1/completions", param="messages")
    return template.render(normalize_messages(body.get("messages")),
                           add_generation_prompt=_typed(body, "add_generation_prompt", bool,
                                                        True))


def _sampling_params(body: dict, chat: bool, defaults) -> SamplingParams:
    """Unset temperature / top_p / top_k: the model's generation_config defaults, else greedy."""
    max_tokens = _typed(body, "max_completion_tokens" if chat else "max_tokens", int, None)
    if max_tokens is None and chat:
        max_tokens = _typed(body, "max_tokens", int, None)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    top_k = _typed(body, "top_k", int, None)
    return SamplingParams(
        max_tokens=SamplingParams().max_tokens if max_tokens is None else max_tokens,
        temperature=float(_typed(body, "temperature", float,
                                 defaults.temperature if defaults else 0.0)),
        top_k=(top_k if top_k > 0 else None) if top_k is not None
        else (defaults.top_k if defaults else None),  # top_k 0 or -1: no cut
        top_p=float(_typed(body, "top_p", float, defaults.top_p if defaults else 1.0)),
        seed=_typed(body, "seed", int, None), stop=tuple(stop or ()),
        ignore_eos=_typed(body, "ignore_eos", bool, False))


def _drafter(body: dict) -> str | None:
    drafter = body.get("drafter")
    if drafter is not None and drafter not in DRAFTERS:
        raise ApiError(400, f"drafter must be one of {DRAFTERS}, got {str(drafter)[:40]!r}",
                       param="drafter")
    return drafter


def _budget(body: dict) -> int | None:
    try:
        return checked_budget(_typed(body, "budget", int, None))
    except InvalidRequest as e:
        raise ApiError(400, str(e), param="budget") from None
