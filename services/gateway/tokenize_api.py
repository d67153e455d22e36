"""The HTTP API's `/tokenize` and `/detokenize` (vLLM's shapes): the token ids a prompt becomes
— exactly those a completion or chat request with it would send to the verifier (a prompt
with the tokenizer's special tokens, e.g. a BOS, unless `add_special_tokens` is false; chat
through the checkpoint's template, which writes its own, as in vLLM) — and the text of ids.

`/tokenize` takes `{"prompt": str}` or chat's `{"messages": [...], "add_generation_prompt"}`
and answers `{"count", "tokens"}` (`"token_strs"` too with `return_token_strs: true`);
`/detokenize` takes `{"tokens": [ids]}` and answers `{"prompt": text}`. Bad bodies are 400s
naming the field.
"""

from __future__ import annotations

from services.gateway.openai_errors import ApiError
from services.gateway.openai_fields import OFF_LOOP_BYTES, check_model, check_text, loads, typed
from specserve.chat_template import ChatTemplate, normalize_messages
from specserve.errors import InvalidRequest
from specserve.tokenizer import Tokenizer

_TOKENIZE = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens",
             "return_token_strs"}


def prompt_text(body, template: ChatTemplate | None, model: str) -> tuple[str, bool, bool]:
    """A /tokenize body's text (raises ApiError 400, 404 for another model), whether it wants
    each token's text, and whether the tokenizer's special tokens are added to it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_text(body)
    check_model(body, model)
    for name in body.keys() - _TOKENIZE:
        raise ApiError(400, f"unknown parameter {name[:60]!r} for tokenize", param=name)
    strs = typed(body, "return_token_strs", bool, False)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    add = typed(body, "add_special_tokens", bool, "prompt" in body)
    if "prompt" in body:
        text = typed(body, "prompt", str, "")
        if not text:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
        return text, strs, add
    if template is None:
        raise ApiError(400, "this model has no chat template", param="messages")
    try:
        return template.render(normalize_messages(body["messages"]), add_generation_prompt=typed(
            body, "add_generation_prompt", bool, True)), strs, add
    except InvalidRequest as e:
        raise ApiError(400, str(e), param="messages") from None


def tokenized(tokenizer: Tokenizer, ids: list[int], strs: bool) -> dict:
    body = {"count": len(ids), "tokens": ids}
    if strs:
        body["token_strs"] = [tokenizer.decode([i]) for i in ids]
    return body


async def detokenized(raw: bytes, prompts, model: str) -> dict:
    """`detokenize` of a raw body; a large one in the prompt worker process (`prompts`, a
    PromptEncoder): a long decode holds the GIL throughout, a thread would stall the loop."""
    if len(raw) <= OFF_LOOP_BYTES:
        return _detokenize_raw(prompts.tokenizer, raw, model)
    return await prompts.run(_detokenize_raw, raw, model)


def _detokenize_raw(tokenizer: Tokenizer, raw: bytes, model: str) -> dict:
    return detokenize(loads(raw), tokenizer, model)


def detokenize(body, tokenizer: Tokenizer, model: str) -> dict:
    """A /detokenize body → {"prompt": text} (raises ApiError 400, 404 for another model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_model(body, model)
    for name in body.keys() - {"model", "tokens"}:
        raise ApiError(400, f"unknown parameter {name[:60]!r} for detokenize", param=name)
    ids = typed(body, "tokens", list, None)
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApiError(400, "tokens must be a list of token ids", param="tokens")
    try:
        return {"prompt": tokenizer.decode(ids)}
    except InvalidRequest as e:
        raise ApiError(400, str(e), param="tokens") from None
