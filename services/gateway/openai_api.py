"""OpenAI API request bodies → the gateway's types.

Requests (`/v1/completions`, `/v1/chat/completions`): the body's JSON → `ApiRequest` (a
validated `GatewayRequest` plus streaming options), refusing what specserve does not implement
or does not know with a clear 400 rather than ignoring it (which fields: openai_fields.py).
Errors are OpenAI error objects (`ApiError`, openai_errors.py) whose `param` names the body
field at fault. Text that is not Unicode (a lone surrogate), an integer too long to parse and a
value the wire cannot carry are 400s too, never 500s. The text leaves out special tokens (EOS
…) unless `skip_special_tokens` is false, as in vLLM. The responses are built in
services/gateway/openai_responses.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from services.common.convert import DRAFTER_NAMES
from services.gateway.convert import GatewayRequest, checked_budget, verify_request_to_pb
from services.gateway.openai_errors import ApiError, invalid
from services.gateway.openai_fields import (
    STREAM_OPTIONS,
    check_fields,
    check_model,
    check_text,
    number,
    typed,
)
from specserve.chat_template import ChatTemplate, normalize_messages
from specserve.errors import InvalidRequest
from specserve.types import INT32_MAX, UINT64_MAX, SamplingParams

DRAFTERS = sorted(n for n in DRAFTER_NAMES.values() if n is not None)  # dflash, ngram, none


MAX_CHOICES = 64  # n × prompts of one request: each is a request of its own at the verifier


@dataclass(frozen=True)
class ApiRequest:
    """A parsed body: one GatewayRequest per choice — prompt i's choice j at index i * n + j."""

    requests: tuple[GatewayRequest, ...]
    n: int  # choices per prompt
    chat: bool
    stream: bool
    include_usage: bool
    id: str  # "cmpl-…" / "chatcmpl-…"
    created: int
    names: dict[str, str] = field(default_factory=dict, hash=False)  # see `body_names`
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion's
    score_only: bool = False  # echo with max_tokens 0: the prompt only (one token generated)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs N: a choice field of its own

    @property
    def request(self) -> GatewayRequest:
        """The first choice's (every choice has the same sampling parameters but its seed)."""
        return self.requests[0]


def body_names(body: dict, chat: bool) -> dict[str, str]:
    """The body's name of each request field an error may name, where it differs: chat's prompt
    is `messages`, its max_tokens whichever of max_completion_tokens / max_tokens it set."""
    if not chat:
        return {}
    legacy = body.get("max_completion_tokens") is None and body.get("max_tokens") is not None
    return {"prompt": "messages", "max_tokens": "max_tokens" if legacy else "max_completion_tokens",
            "logprobs": "top_logprobs"}


def parse(body, chat: bool, model: str, template: ChatTemplate | None,
          defaults=None) -> ApiRequest:
    """A request body → ApiRequest. Raises ApiError (400; 404 for another model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_text(body)
    names = body_names(body, chat)
    try:
        return _parse(body, chat, model, template, defaults, names)
    except InvalidRequest as e:
        raise invalid(e, names) from None
    except (ValueError, TypeError, OverflowError) as e:  # a value the wire cannot carry
        raise ApiError(400, f"invalid request: {e}") from None


def _parse(body: dict, chat: bool, model: str, template, defaults,
           names: dict[str, str]) -> ApiRequest:
    check_model(body, model)
    check_fields(body, chat)
    prompts = [_chat_prompt(body, template)] if chat else _completion_prompts(body.get("prompt"))
    stream = typed(body, "stream", bool, False)
    include_usage = _include_usage(body, stream)
    n = _n(body, len(prompts))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # the response's id too
    echo = not chat and typed(body, "echo", bool, False)
    score_only = echo and typed(body, "max_tokens", int, None) == 0
    params = _sampling_params({**body, "max_tokens": 1} if score_only else body, chat, defaults)
    params = replace(params, prompt_logprobs=_prompt_logprobs(body, chat, echo, params.logprobs))
    drafter, budget = _drafter(body), _budget(body)
    keep = not typed(body, "skip_special_tokens", bool, True)
    add = typed(body, "add_special_tokens", bool, not chat)  # chat: the template writes its own
    requests = []
    for k in range(len(prompts) * n):  # choice j of a seeded request: seed + j
        prompt, seed = prompts[k // n], params.seed
        request = GatewayRequest(
            rid if len(prompts) * n == 1 else f"{rid}-{k}",
            prompt if isinstance(prompt, str) else None,
            tuple(prompt) if isinstance(prompt, list) else None,
            params if seed is None else replace(params, seed=(seed + k % n) % (UINT64_MAX + 1)),
            drafter, budget, keep_special_tokens=keep, add_special_tokens=add)
        verify_request_to_pb(request, [])  # what the verifier will get converts (else a 400)
        requests.append(request)
    return ApiRequest(tuple(requests), n, chat, stream, include_usage, rid, int(time.time()),
                      names, echo, score_only,
                      None if chat else typed(body, "prompt_logprobs", int, None))


def _n(body: dict, prompts: int) -> int:
    """Choices per prompt: `n` (best_of, if given, must equal it)."""
    n = typed(body, "n", int, 1)
    if not 1 <= n * prompts <= MAX_CHOICES:
        raise ApiError(400, f"n × prompts must be in [1, {MAX_CHOICES}], got {n} × {prompts}",
                       param="n")
    if typed(body, "best_of", int, n) != n:
        raise ApiError(400, "best_of other than n is not supported by specserve",
                       param="best_of")
    return n


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream or not isinstance(options, dict):
        raise ApiError(400, "stream_options needs stream: true and is an object",
                       param="stream_options")
    for name in options.keys() - STREAM_OPTIONS:
        raise ApiError(400, f"unknown stream_options field {name[:40]!r}",
                       param="stream_options")
    typed(options, "include_obfuscation", bool, False)  # checked, and ignored
    return typed(options, "include_usage", bool, False)


def _completion_prompts(prompt) -> list[str | list[int]]:
    """The prompts: a string, a token-id list, or a batch (a list of either)."""
    batch = prompt if isinstance(prompt, list) and prompt and all(
        isinstance(p, str | list) for p in prompt) else [prompt]
    for p in batch:
        if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise ApiError(400, "prompt must be a non-empty string or token-id list, or a "
                           "list of them", param="prompt")
    return batch


def _chat_prompt(body: dict, template: ChatTemplate | None) -> str:
    if template is None:
        raise ApiError(400, "this model has no chat template (tokenizer_config.json "
                       "chat_template); use /v1/completions", param="messages")
    return template.render(normalize_messages(body.get("messages")),
                           add_generation_prompt=typed(body, "add_generation_prompt", bool,
                                                        True))


def _sampling_params(body: dict, chat: bool, defaults) -> SamplingParams:
    """Unset temperature / top_p / top_k: the model's generation_config defaults, else greedy."""
    max_tokens = typed(body, "max_completion_tokens" if chat else "max_tokens", int, None)
    if max_tokens is None and chat:
        max_tokens = typed(body, "max_tokens", int, None)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return SamplingParams(
        max_tokens=SamplingParams().max_tokens if max_tokens is None else max_tokens,
        temperature=number(body, "temperature", defaults.temperature if defaults else 0.0),
        top_k=_top_k(body, defaults),
        top_p=number(body, "top_p", defaults.top_p if defaults else 1.0),
        seed=typed(body, "seed", int, None), stop=tuple(stop or ()),
        stop_token_ids=_stop_token_ids(body), ignore_eos=typed(body, "ignore_eos", bool, False),
        include_stop_str_in_output=typed(body, "include_stop_str_in_output", bool, False),
        logprobs=_logprobs(body, chat))


def _prompt_logprobs(body: dict, chat: bool, echo: bool, logprobs: int | None) -> int | None:
    """Alternatives per prompt token (None: no prompt logprobs): vLLM's `prompt_logprobs` N,
    and an echoed completion's `logprobs` N (its logprobs cover the prompt too)."""
    asked = None if chat else typed(body, "prompt_logprobs", int, None)
    if echo and logprobs is not None:
        return max(asked or 0, logprobs)
    return asked


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs): completions'
    `logprobs` N; chat's `top_logprobs` N under `logprobs: true`."""
    if not chat:
        return typed(body, "logprobs", int, None)
    top = typed(body, "top_logprobs", int, None)
    if not typed(body, "logprobs", bool, False):
        if top:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: token ids that end the generation as EOS does."""
    ids = typed(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
    return tuple(ids)


def _top_k(body: dict, defaults) -> int | None:
    """top_k 0 (as over gRPC) or -1 (vLLM's way to say it): no cut; other negatives: refused;
    unset: the model's default."""
    top_k = typed(body, "top_k", int, None)
    if top_k is None:
        return defaults.top_k if defaults else None
    if not -1 <= top_k <= INT32_MAX:
        raise ApiError(400, f"top_k must be in [1, {INT32_MAX}], or 0 / -1 for no cut, got "
                       f"{str(top_k)[:40]}", param="top_k")
    return top_k if top_k > 0 else None


def _drafter(body: dict) -> str | None:
    drafter = body.get("drafter")
    if drafter is not None and drafter not in DRAFTERS:
        raise ApiError(400, f"drafter must be one of {DRAFTERS}, got {str(drafter)[:40]!r}",
                       param="drafter")
    return drafter


def _budget(body: dict) -> int | None:
    try:
        return checked_budget(typed(body, "budget", int, None))
    except InvalidRequest as e:
        raise ApiError(400, str(e), param="budget") from None
