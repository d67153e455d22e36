"""Gateway wire ⇄ core types: the only gateway module that touches pb2 messages.

Server side: `GenerateRequest` → `GatewayRequest` (validated), → `VerifyRequest`; `VerifyEvent`
→ `Step` / `VerifierFinal`; `Chunk` / `Final` out. Client side (the `specserve generate` CLI):
`generate_request_to_pb` and `response_from_pb`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, replace

from services.cli.wire import TRACE_ID_KEY, logprobs_from_pb
from services.cli.wire import Final as GatewayFinal  # what the client reads, as sent
from services.common.convert import (
    DRAFTER_NAMES,
    finish_from_pb,
    finish_to_pb,
    logprobs_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    spec_stats_to_pb,
)
from specserve.errors import InvalidRequest, check_request_id
from specserve.spec.metrics import RequestSpecStats
from specserve.spec.tree import check_budget
from specserve.types import FinishReason, SamplingParams, TokenLogprob
from specserve.v1 import common_pb2, gateway_pb2, verifier_pb2

DRAFTER_KINDS = {name: kind for kind, name in DRAFTER_NAMES.items() if name is not None}


@dataclass(frozen=True)
class GatewayRequest:
    """A validated client request: exactly one of `text` / `token_ids` is set."""

    request_id: str
    text: str | None
    token_ids: tuple[int, ...] | None
    params: SamplingParams
    drafter: str | None  # None = the verifier's default
    budget: int | None  # None = the verifier's default
    keep_special_tokens: bool = False  # text shows special tokens (EOS …); default: left out
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's special tokens (BOS …)


@dataclass(frozen=True)
class Step:
    """What one verifier step committed (token_ids may be shorter than commit_len when cut)."""

    token_ids: tuple[int, ...]
    commit_len: int
    accepted_depth: int
    tree_size: int = 0
    budget: int = 0
    fallback: str = ""
    shape: str = ""  # adaptive speculation's choice ("" = not adaptive)
    why: str = ""  # and the expected rates behind it ("" = not adaptive)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first step's, when asked: tokens 1..
    prompt_ids: tuple[int, ...] = ()  # with prompt_logprobs: the prompt's ids (the gateway's)


@dataclass(frozen=True)
class VerifierFinal:
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    stats: RequestSpecStats
    other_s: float = 0.0


# ---- server side ---------------------------------------------------------------------------
def request_from_pb(msg: gateway_pb2.GenerateRequest, defaults=None) -> GatewayRequest:
    """Raises InvalidRequest for an empty prompt, bad sampling params, an unknown drafter or a
    budget outside [0, MAX_BUDGET]. Sampling values the request leaves unset come from
    `defaults` (the model's)."""
    which = msg.WhichOneof("prompt")
    text = msg.text if which == "text" else None
    ids = tuple(msg.token_ids.ids) if which == "token_ids" else None  # ints already
    if not text and not ids:
        raise InvalidRequest("prompt is empty: set a non-empty text or token_ids")
    if msg.spec.drafter not in DRAFTER_NAMES:
        raise InvalidRequest(f"unknown drafter kind {msg.spec.drafter}; expected one of "
                             f"{sorted(DRAFTER_NAMES)} (unspecified, dflash, ngram, none)")
    budget = checked_budget(msg.spec.budget if msg.spec.HasField("budget") else None)
    params = sampling_from_pb(msg.sampling, defaults) if msg.HasField("sampling") else \
        sampling_from_pb(common_pb2.SamplingParams(max_tokens=SamplingParams().max_tokens),
                         defaults)
    rid = check_request_id(msg.request_id) if msg.request_id else uuid.uuid4().hex
    add = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    return GatewayRequest(rid, text, ids, params, DRAFTER_NAMES[msg.spec.drafter], budget,
                          msg.keep_special_tokens, add)


def checked_budget(budget: int | None) -> int | None:
    """A request's budget (None: the verifier's default), checked at the edge against the core's
    bound on any tree (`MAX_BUDGET`; the verifier caps it at its --max-draft-tokens, the engine
    checks its own). Raises InvalidRequest."""
    if budget is not None:
        try:
            check_budget(budget)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
    return budget


def verify_request_to_pb(req: GatewayRequest, prompt_ids: list[int]) -> verifier_pb2.VerifyRequest:
    """Stop strings stay at the gateway; everything else goes to the verifier."""
    spec = common_pb2.SpecOptions(drafter=DRAFTER_KINDS.get(req.drafter, 0))
    if req.budget is not None:
        spec.budget = req.budget
    return verifier_pb2.VerifyRequest(
        request_id=req.request_id, prompt_ids=prompt_ids,
        sampling=sampling_to_pb(replace(req.params, stop=())), spec=spec)


def event_from_pb(ev: verifier_pb2.VerifyEvent) -> tuple[Step | None, VerifierFinal | None]:
    """A verifier event → (the step it carries, if any; the final, if it is the last one)."""
    step = None
    if ev.token_ids or ev.commit_len:
        step = Step(tuple(ev.token_ids), ev.commit_len, ev.accepted_depth, ev.tree_size,
                    ev.budget, ev.fallback, ev.shape, ev.why, logprobs_from_pb(ev.logprobs),
                    logprobs_from_pb(ev.prompt_logprobs))
    final = None
    if ev.HasField("final"):
        f = ev.final
        stats, other_s = spec_stats_from_pb(f.stats)
        final = VerifierFinal(finish_from_pb(f.finish_reason), f.usage.prompt_tokens,
                              f.usage.completion_tokens, stats, other_s)
    return step, final


def chunk_to_pb(text: str, step: Step | None) -> gateway_pb2.GenerateResponse:
    """A chunk per verifier step; `step` None for trailing text released at the end."""
    if step is None:
        return gateway_pb2.GenerateResponse(chunk=gateway_pb2.Chunk(text=text))
    chunk = gateway_pb2.Chunk(text=text, token_ids=step.token_ids, commit_len=step.commit_len,
                              accepted_depth=step.accepted_depth, tree_size=step.tree_size,
                              shape=step.shape, fallback=step.fallback, why=step.why)
    logprobs_to_pb(step.logprobs, chunk.logprobs)
    logprobs_to_pb(step.prompt_logprobs, chunk.prompt_logprobs)
    return gateway_pb2.GenerateResponse(chunk=chunk)


def final_to_pb(f: GatewayFinal) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(final=gateway_pb2.Final(
        finish_reason=finish_to_pb(f.finish_reason),
        usage=common_pb2.Usage(prompt_tokens=f.prompt_tokens,
                               completion_tokens=f.completion_tokens),
        stats=spec_stats_to_pb(f.stats, f.other_s), request_id=f.request_id,
        ttft_s=f.ttft_s, wall_s=f.wall_s, verifier=f.verifier))


def spec_stats_from_pb(msg: common_pb2.SpecStats) -> tuple[RequestSpecStats, float]:
    """(the stats, other_s) — the inverse of services.common.convert.spec_stats_to_pb."""
    stats = RequestSpecStats(
        steps=msg.steps, draft_tokens=msg.draft_tokens, accepted_tokens=msg.accepted_tokens,
        committed_tokens=msg.committed_tokens, commit_len_hist=Counter(msg.commit_len_hist),
        accepted_per_position=Counter(msg.accepted_per_position),
        fallbacks=Counter(msg.fallbacks), shapes=Counter(msg.shapes),
        prefill_s=msg.phases.prefill_s, draft_s=msg.phases.draft_s,
        verify_s=msg.phases.verify_s, commit_s=msg.phases.commit_s, device=msg.device)
    return stats, msg.phases.other_s


# ---- client side ---------------------------------------------------------------------------
def generate_request_to_pb(prompt: str | list[int], params: SamplingParams,
                           drafter: str | None = None, budget: int | None = None,
                           request_id: str = "", add_special_tokens: bool | None = None
                           ) -> gateway_pb2.GenerateRequest:
    """`add_special_tokens`: for a text prompt (None: the gateway's default, true)."""
    msg = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling_to_pb(params))
    if isinstance(prompt, str):
        msg.text = prompt
        if add_special_tokens is not None:
            msg.add_special_tokens = add_special_tokens
    else:
        msg.token_ids.ids.extend(prompt)
    if drafter is not None:
        if drafter not in DRAFTER_KINDS:
            raise InvalidRequest(f"unknown drafter {drafter!r}; expected {sorted(DRAFTER_KINDS)}")
        msg.spec.drafter = DRAFTER_KINDS[drafter]
    if budget is not None:
        msg.spec.budget = budget
    return msg


def response_from_pb(msg: gateway_pb2.GenerateResponse) -> tuple[str, Step] | GatewayFinal:
    """A chunk → (text delta, step); the final → GatewayFinal."""
    if msg.WhichOneof("event") == "chunk":
        c = msg.chunk
        return c.text, Step(tuple(c.token_ids), c.commit_len, c.accepted_depth, c.tree_size,
                            fallback=c.fallback, shape=c.shape, why=c.why)  # no budget sent
    f = msg.final
    stats, other_s = spec_stats_from_pb(f.stats)
    return GatewayFinal(finish_from_pb(f.finish_reason), f.usage.prompt_tokens,
                        f.usage.completion_tokens, stats, other_s, f.request_id, f.ttft_s,
                        f.wall_s, f.verifier)


def trace_id_from_metadata(metadata) -> str | None:
    """The request's trace id from a Generate call's initial metadata (None: not exported)."""
    for key, value in metadata or ():
        if key == TRACE_ID_KEY:
            return value
    return None
