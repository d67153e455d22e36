"""OpenAI API request bodies → the gateway's types, and OpenAI error objects.

Requests (`/v1/completions`, `/v1/chat/completions`): the body's JSON (`loads`) → `ApiRequest` (a
validated `GatewayRequest` plus streaming options), refusing what specserve does not implement
with a clear 400 rather than ignoring it. Errors are OpenAI error objects (`ApiError`) whose
`param` names the body field at fault as the body calls it (chat's `messages`,
`max_completion_tokens`), whether the check that failed is here, in SamplingParams, in the
pipeline or at the verifier. Text that is not Unicode (a lone surrogate), an integer too long
to parse and a value the wire cannot carry are 400s too, never 500s. The responses are built in
services/gateway/openai_responses.py.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field

import grpc

from services.common.convert import DRAFTER_NAMES
from services.gateway.convert import GatewayRequest, checked_budget, verify_request_to_pb
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
# the request fields an error message can name (the first it names is the error's param)
_FIELD_WORD = re.compile(r"\b(max_tokens|temperature|top_k|top_p|seed|stop|budget|drafter|"
                         r"prompt|messages|token ids?)\b")


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
    def of_grpc(cls, code: grpc.StatusCode, message: str,
                names: dict[str, str] | None = None) -> ApiError:
        """A failed generation's error; a 400's param: the field its message names."""
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        param = named_field(message, names or {}) if status == 400 else None
        return cls(status, message, type_, param, code.name.lower())


@dataclass(frozen=True)
class ApiRequest:
    request: GatewayRequest
    chat: bool
    stream: bool
    include_usage: bool
    id: str  # "cmpl-…" / "chatcmpl-…"
    created: int
    names: dict[str, str] = field(default_factory=dict, hash=False)  # see `body_names`


class TooLong:
    """A JSON integer of more digits than Python converts (sys.get_int_max_str_digits())."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def loads(raw: bytes):
    """The request body's JSON; ApiError 400 if it is not JSON. An integer too long to convert
    is a TooLong, which the check of the field holding it refuses."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not JSON: nested too deeply") from None
    except ValueError:  # an integer over the digit limit
        return json.loads(raw, parse_int=_int)


def _int(text: str) -> int | TooLong:
    try:
        return int(text)
    except ValueError:
        return TooLong(text)


def body_names(body: dict, chat: bool) -> dict[str, str]:
    """The body's name of each request field an error may name, where it differs: chat's prompt
    is `messages`, its max_tokens whichever of max_completion_tokens / max_tokens it set."""
    if not chat:
        return {}
    legacy = body.get("max_completion_tokens") is None and body.get("max_tokens") is not None
    return {"prompt": "messages", "max_tokens": "max_tokens" if legacy else "max_completion_tokens"}


def named_field(message: str, names: dict[str, str]) -> str | None:
    """The body field an error message is about: the first request field it names, if any."""
    if (m := _FIELD_WORD.search(message)) is None:
        return None
    name = "prompt" if m.group(1).startswith("token id") else m.group(1)
    return names.get(name, name)


def invalid(e: InvalidRequest, names: dict[str, str]) -> ApiError:
    """The 400 for a request the core refused, naming its field (`InvalidRequest.param`, else
    the first the message names) as the body does — in the message too."""
    message, name = str(e), getattr(e, "param", None)
    if name is None:
        return ApiError(400, message, param=named_field(message, names))
    param = names.get(name, name)
    if message.startswith(f"{name} "):
        message = param + message[len(name):]
    return ApiError(400, message, param=param)


def parse(body, chat: bool, model: str, template: ChatTemplate | None,
          defaults=None) -> ApiRequest:
    """A request body → ApiRequest. Raises ApiError (400; 404 for another model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_text(body)
    names = body_names(body, chat)
    try:
        return _parse(body, chat, model, template, defaults, names)
    except InvalidRequest as e:
        raise invalid(e, names) from None
    except (ValueError, TypeError, OverflowError) as e:  # a value the wire cannot carry
        raise ApiError(400, f"invalid request: {e}") from None


def _parse(body: dict, chat: bool, model: str, template, defaults,
           names: dict[str, str]) -> ApiRequest:
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
    verify_request_to_pb(request, [])  # what the verifier will get converts (else a 400)
    return ApiRequest(request, chat, stream, include_usage,
                      f"{'chatcmpl' if chat else 'cmpl'}-{rid}", int(time.time()), names)


def _check_text(body: dict) -> None:
    """Refuse text that is not Unicode — a lone surrogate (JSON escapes one: "\\ud800"), which no
    tokenizer nor UTF-8 encoder takes — naming the top-level field holding it."""
    for key, value in body.items():
        todo = [key, value]
        while todo:
            item = todo.pop()
            if isinstance(item, list):
                todo.extend(item)
            elif isinstance(item, dict):
                todo.extend(item.keys())
                todo.extend(item.values())
            elif isinstance(item, str) and not _is_unicode(item):
                name = key if _is_unicode(key) else None
                raise ApiError(400, f"{name or 'a field name'} is not valid Unicode text: it "
                               "holds a lone surrogate (such as \\ud800)", param=name)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _typed(body: dict, name: str, kind, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, TooLong):
        raise ApiError(400, f"{name} is out of range: {value!r}", param=name)
    if kind is float:  # an int is a float here; a bool is never a number
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise ApiError(400, f"{name} must be {kind.__name__}, got {str(value)[:60]!r}",
                       param=name)
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = _typed(body, name, float, default)
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        raise ApiError(400, f"{name} is out of range: {str(value)[:20]}… ({len(str(value))} "
                       "digits)", param=name) from None


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
    return SamplingParams(
        max_tokens=SamplingParams().max_tokens if max_tokens is None else max_tokens,
        temperature=_float(body, "temperature", defaults.temperature if defaults else 0.0),
        top_k=_top_k(body, defaults),
        top_p=_float(body, "top_p", defaults.top_p if defaults else 1.0),
        seed=_typed(body, "seed", int, None), stop=tuple(stop or ()),
        ignore_eos=_typed(body, "ignore_eos", bool, False))


def _top_k(body: dict, defaults) -> int | None:
    """top_k 0 (as over gRPC) or -1 (vLLM's way to say it): no cut; other negatives: refused;
    unset: the model's default."""
    top_k = _typed(body, "top_k", int, None)
    if top_k is None:
        return defaults.top_k if defaults else None
    if top_k < -1:
        raise ApiError(400, f"top_k must be > 0, or 0 / -1 for no cut, got {str(top_k)[:40]}",
                       param="top_k")
    return top_k if top_k > 0 else None


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
