"""OpenAI API response bodies from the pipeline's results: whole completions, stream chunks, the
usage chunk, and the request's speculative decoding stats.

`speculative_decoding` rides on the whole response and on the stream's finishing chunk (vLLM
reports the same figures as server metrics; here they are per request): steps (verifier steps
that drafted), draft and accepted tokens, the mean acceptance length (tokens committed per
step: accepted drafts + the target's own token), the histogram of committed tokens per step,
how often each tree depth was accepted, steps that fell back to plain decoding by reason, and
the phase times.

`logprobs` (when asked) is OpenAI's object for a run of tokens: completions' `tokens`,
`token_logprobs`, `top_logprobs` (the N best and the chosen token, by text) and `text_offset`;
chat's `content` list of {token, logprob, bytes, top_logprobs}. A token's text is its own
decode (U+FFFD for part of a character; `bytes` has its real bytes). A streamed body is
server-sent events (`sse`), JSON with the line separators escaped.
"""

from __future__ import annotations

import codecs
import functools
import json

from services.gateway.convert import GatewayFinal
from services.gateway.openai_api import ApiRequest
from specserve.tokenizer import Tokenizer
from specserve.types import FinishReason, TokenLogprob


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else ("length" if reason is FinishReason.LENGTH else "stop")


def _reason(api: ApiRequest, final: GatewayFinal) -> str | None:
    """A choice's finish_reason: an echo with max_tokens 0 stops at its length, 0."""
    return "length" if api.score_only else finish_reason(final.finish_reason)


def usage(api: ApiRequest, finals: list[GatewayFinal]) -> dict:
    """The tokens of all choices; each prompt counted once, whatever its `n`."""
    prompt = sum(f.prompt_tokens for f in finals[::api.n])
    completion = 0 if api.score_only else sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def speculative_decoding(final: GatewayFinal) -> dict:
    s = final.stats
    return {
        "steps": s.steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
        "mean_acceptance_length": s.mean_commit_len,
        "acceptance_length_histogram": {str(k): v for k, v in sorted(s.commit_len_hist.items())},
        "accepted_per_position": {str(k): v
                                  for k, v in sorted(s.accepted_per_position.items())},
        "fallbacks": dict(s.fallbacks), "shapes": dict(s.shapes),
        "ttft_s": final.ttft_s, "wall_s": final.wall_s,
        "phases_s": {"prefill": s.prefill_s, "draft": s.draft_s, "verify": s.verify_s,
                     "commit": s.commit_s, "other": final.other_s},
    }


@functools.lru_cache(maxsize=1 << 18)
def _text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's own text (cached: a long prompt's logprobs list many, on the event loop)."""
    return tokenizer.decode([token_id])


@functools.lru_cache(maxsize=1 << 18)
def _bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    return tokenizer.token_bytes(token_id)


class TextOffsets:
    """Where each token's text starts in a choice's text (completions' `text_offset`): the
    tokens' own bytes through one incremental UTF-8 decoder, so part of a character counts
    once the character is whole, and a special token left out of the text counts 0."""

    def __init__(self, tokenizer: Tokenizer, keep_special: bool) -> None:
        self._tok, self._keep = tokenizer, keep_special
        self._utf8, self.chars = codecs.getincrementaldecoder("utf-8")("replace"), 0

    def take(self, ids) -> list[int]:
        """The offsets of `ids`, the choice's next tokens."""
        out, skip = [], frozenset() if self._keep else self._tok.special_ids
        for i in ids:
            if i in skip:
                out.append(self.chars)
                continue
            data = _bytes(self._tok, i)
            # a character left unfinished by the tokens before, that this one does not go on
            # with, becomes a U+FFFD of theirs, in front of this token's text
            cut = bool(self._utf8.getstate()[0]) and bool(data) and not 0x80 <= data[0] <= 0xBF
            out.append(self.chars + cut)
            self.chars += len(self._utf8.decode(data))
        return out


def logprobs(api: ApiRequest, tokenizer: Tokenizer, ids, lps: list[TokenLogprob],
             offsets: TextOffsets | None = None) -> dict | None:
    """The logprobs object of tokens `ids` (None when the request asked for none); `offsets`:
    the choice's text offsets (completions')."""
    if api.request.params.logprobs is None:
        return None
    texts = [_text(tokenizer, i) for i in ids]
    if api.chat:
        def entry(token_id: int, text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(_bytes(tokenizer, token_id))}

        return {"content": [{**entry(i, text, t.logprob), "top_logprobs": [
            entry(j, _text(tokenizer, j), v) for j, v in zip(t.top_ids, t.top_logprobs,
                                                               strict=True)]}
            for i, text, t in zip(ids, texts, lps, strict=True)]}
    offsets = (offsets or TextOffsets(tokenizer, True)).take(ids)
    tops = [{**{_text(tokenizer, j): v for j, v in zip(t.top_ids, t.top_logprobs,
                                                         strict=True)}, text: t.logprob}
            for text, t in zip(texts, lps, strict=True)]
    return {"tokens": texts, "token_logprobs": [t.logprob for t in lps], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_part(api: ApiRequest, tokenizer: Tokenizer, k: int, step,
                offsets: TextOffsets) -> tuple[str, dict]:
    """Choice `k`'s echoed prompt (`step`: its first, which carries the prompt's ids and
    logprobs when asked): its text, and what its choice adds (`logprobs` over the prompt —
    the first token's null — and vLLM's `prompt_logprobs`)."""
    r = api.requests[k]
    text = r.text if r.text is not None else tokenizer.decode(list(r.token_ids))
    ids, lps, extra = list(step.prompt_ids), list(step.prompt_logprobs), {}
    if api.prompt_logprobs is not None and ids:
        extra["prompt_logprobs"] = [None, *({**{str(j): _vllm(tokenizer, j, v) for j, v in zip(
            t.top_ids[:api.prompt_logprobs], t.top_logprobs, strict=False)},
            str(i): _vllm(tokenizer, i, t.logprob)} for i, t in zip(ids[1:], lps, strict=True))]
    if api.echo and ids and (n := api.request.params.logprobs) is not None:
        head = offsets.take(ids[:1])  # each token: the N best the generated ones get
        rest = logprobs(api, tokenizer, ids[1:], [TokenLogprob(
            t.logprob, t.top_ids[:n], t.top_logprobs[:n]) for t in lps], offsets)
        extra["logprobs"] = {"tokens": [tokenizer.decode(ids[:1]), *rest["tokens"]],
                             "token_logprobs": [None, *rest["token_logprobs"]],
                             "top_logprobs": [None, *rest["top_logprobs"]],
                             "text_offset": [*head, *rest["text_offset"]]}
    return (text if api.echo else ""), extra


class Deltas:
    """Each choice's text and logprobs, event by event, as both the whole response and the
    stream show them: a choice's first TextChunk brings its prompt's part first
    (`prompt_part`), and its text offsets run on across its chunks."""

    def __init__(self, api: ApiRequest, tokenizer: Tokenizer) -> None:
        self.api, self._tok = api, tokenizer
        self._offsets = [TextOffsets(tokenizer, r.keep_special_tokens) for r in api.requests]
        self._started: set[int] = set()  # choices past their first event

    def __call__(self, k: int, event) -> tuple[str, dict | None, dict]:
        """Choice `k`'s text and logprobs object for a TextChunk (an echoed prompt's first),
        and the fields its choice adds (vLLM's prompt_logprobs; {} but on its first)."""
        api, step, head, extra = self.api, event.step, "", {}
        if k not in self._started and step is not None and (
                api.echo or api.prompt_logprobs is not None):
            head, extra = prompt_part(api, self._tok, k, step, self._offsets[k])
        self._started.add(k)
        prompt_lps = extra.pop("logprobs", None)
        if api.score_only:
            return head, prompt_lps, extra
        lps = None if step is None else logprobs(api, self._tok, step.token_ids,
                                                 step.logprobs, self._offsets[k])
        return head + event.text, joined(prompt_lps, lps), extra


def _vllm(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    return {"logprob": logprob, "decoded_token": _text(tokenizer, token_id)}


def joined(a: dict | None, b: dict | None) -> dict | None:
    """Two completions logprobs objects, one after the other."""
    return b if a is None else a if b is None else {key: a[key] + b[key] for key in a}


def _head(api: ApiRequest, model: str, chunk: bool) -> dict:
    kind = ("chat.completion" if api.chat else "text_completion") + \
        (".chunk" if chunk and api.chat else "")
    return {"id": api.id, "object": kind, "created": api.created, "model": model}


def whole(api: ApiRequest, model: str, texts: list[str], finals: list[GatewayFinal],
          lps: list[dict | None], extras: list[dict] | None = None) -> dict:
    """The non-streamed response: a choice per request (`lps`: each one's logprobs object,
    `extras`: fields a choice adds, vLLM's prompt_logprobs). One choice's stats are the
    response's `speculative_decoding`; several choices carry their own."""
    choices = []
    for k, (text, final, lp) in enumerate(zip(texts, finals, lps, strict=True)):
        choice = {"index": k, "logprobs": lp, "finish_reason": _reason(api, final),
                  **(extras[k] if extras else {})}
        if api.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if len(finals) > 1:
            choice["speculative_decoding"] = speculative_decoding(final)
        choices.append(choice)
    body = {**_head(api, model, False), "choices": choices, "usage": usage(api, finals)}
    if len(finals) == 1:
        body["speculative_decoding"] = speculative_decoding(finals[0])
    return body


def chunk(api: ApiRequest, model: str, text: str, final: GatewayFinal | None = None,
          first: bool = False, lps: dict | None = None, index: int = 0,
          extra: dict | None = None) -> dict:
    """A stream chunk of choice `index`: a text delta (`lps`: its tokens' logprobs object); with
    `final`, the choice's finishing one (its reason and stats); `first` (chat): the delta that
    names the assistant role."""
    choice = {"index": index, "logprobs": lps,
              "finish_reason": _reason(api, final) if final else None}
    if api.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text or final is None else {})
    else:
        choice["text"] = text
    choice.update(extra or {})
    body = {**_head(api, model, True), "choices": [choice]}
    if api.include_usage:
        body["usage"] = None
    if final is not None:
        body["speculative_decoding"] = speculative_decoding(final)
    return body


def usage_chunk(api: ApiRequest, model: str, finals: list[GatewayFinal]) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage of all."""
    return {**_head(api, model, True), "choices": [], "usage": usage(api, finals)}


def models(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specserve"}]}


# line separators a line-based SSE reader would split a JSON event at (legal JSON unescaped)
_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {render(obj).translate(_SEPARATORS)}\n\n"


SLICE = 256  # list items a single json.dumps call renders (it holds the GIL throughout)


def render(obj, depth: int = 0) -> str:
    """`obj` as compact JSON, rendered piece by piece: the containers near the top one value at
    a time, long lists SLICE items at a time — between the pieces other threads, the event
    loop among them, get the GIL (a response with a million logprob entries is one C call of a
    second or more otherwise)."""
    if isinstance(obj, dict) and depth < 4:
        return "{" + ",".join(f"{_dumps(str(k))}:{render(v, depth + 1)}"
                              for k, v in obj.items()) + "}"
    if isinstance(obj, list) and (depth < 2 or len(obj) > SLICE):
        if depth < 2:
            return "[" + ",".join(render(v, depth + 1) for v in obj) + "]"
        return "[" + ",".join(_dumps(obj[i:i + SLICE])[1:-1]
                              for i in range(0, len(obj), SLICE)) + "]"
    return _dumps(obj)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
