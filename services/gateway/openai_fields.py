"""Which OpenAI request-body fields the HTTP API takes, and typed access to them.

Every top-level field of a body is one of: read (`READ`, per route), accepted and ignored
because it changes no output (`IGNORED`: OpenAI's bookkeeping fields), or refused with a 400
that names it unless it holds a neutral value (`NEUTRAL`: OpenAI's and vLLM's parameters
specserve does not implement — a penalty, tools, guided decoding — whose neutral value asks
for nothing). Any other field is refused as unknown, as OpenAI's API does: a parameter that
would change the output is never silently dropped. Values are compared by type as well, so
`n: 1.0` is not `1`.

`loads` parses a body (an integer too long to convert becomes a `TooLong`, refused by the check
of the field that holds it); `check_text` refuses text that is not Unicode; `typed` / `number`
read one field of a given type.
"""

from __future__ import annotations

import json

from services.gateway.openai_errors import ApiError
from specserve.json_values import one_of

_BOTH = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
         "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "drafter",
         "budget", "n", "add_special_tokens", "include_stop_str_in_output"}
READ = {False: _BOTH | {"prompt", "logprobs", "best_of", "echo", "prompt_logprobs"},
        True: _BOTH | {"messages", "max_completion_tokens", "add_generation_prompt", "logprobs",
                       "top_logprobs"}}
IGNORED = {"user", "metadata", "store", "service_tier", "request_id", "safety_identifier",
           "prompt_cache_key", "prompt_cache_retention"}
NEUTRAL: dict[str, tuple] = {
    # OpenAI (a route that reads a field never looks it up here)
    "top_logprobs": (None, 0), "echo": (None, False),
    "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
    # vLLM's extensions
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
    "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False),
    "spaces_between_special_tokens": (None, True),
    "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
    "return_tokens_as_token_ids": (None, False), "truncate_prompt_tokens": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,), "logits_processors": (None,),
    "priority": (None, 0), "mm_processor_kwargs": (None,),
}
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # the latter: no padding is ever sent


def check_fields(body: dict, chat: bool) -> None:
    """Refuse (400, naming it) a field that is unknown, or not neutral where specserve does not
    implement what it asks."""
    for name, value in body.items():
        if name in READ[chat] or name in IGNORED:
            continue
        if name not in NEUTRAL:
            route = "chat completions" if chat else "completions"
            raise ApiError(400, f"unknown parameter {_show(name)} for {route}", param=name)
        if not one_of(value, NEUTRAL[name]):
            raise ApiError(400, f"{name}={_show(value)} is not supported by specserve (leave it "
                           "unset)", param=name)


def _show(value) -> str:
    """A value as JSON, cut to 60 characters."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:59] + "…"


class TooLong:
    """A JSON integer of more digits than Python converts (sys.get_int_max_str_digits())."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


OFF_LOOP_BYTES = 256 << 10  # a larger body is parsed and checked off the event loop


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


def check_text(body: dict) -> None:
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


def typed(body: dict, name: str, kind, default):
    """`body[name]` if it is a `kind` (a bool is never a number; an int is a float), `default`
    if unset or null; ApiError 400 naming it otherwise."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, TooLong):
        raise ApiError(400, f"{name} is out of range: {value!r}", param=name)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise ApiError(400, f"{name} must be {kind.__name__}, got {_show(value)}", param=name)
    return value


def number(body: dict, name: str, default: float) -> float:
    """A float field (an int past float's range: 400)."""
    value = typed(body, name, float, default)
    try:
        return float(value)
    except OverflowError:
        raise ApiError(400, f"{name} is out of range: {str(value)[:20]}… ({len(str(value))} "
                       "digits)", param=name) from None


def check_model(body: dict, model: str) -> None:
    """`model`, if the body names one, must be the served one (404 otherwise)."""
    if typed(body, "model", str, model) != model:
        raise ApiError(404, f"model {body['model'][:100]!r} is not served here; this gateway "
                       f"serves {model!r}", "not_found_error", "model", "model_not_found")


async def read_body(request, limit: int) -> bytes:
    """A Starlette request's body bytes; ApiError 413 past `limit` bytes."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"request body of {int(size)} bytes is over the limit of {limit}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
