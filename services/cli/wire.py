"""The gateway client's wire conversions, without torch: the GenerateRequest that `specserve
generate` and `probe` send and the GenerateResponse events they read.

They equal the client half of services.gateway.convert (tests/unit/test_cli_usage.py compares
them); that module imports services.common.convert and so torch, seconds before a client's
first byte. Only pb2 messages and core types here; grpc itself stays with the callers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from specserve.drafters.registry import DFLASH, NGRAM, NONE
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FLOAT32_TINY, FinishReason, SamplingParams, TokenLogprob
from specserve.v1 import common_pb2 as pb
from specserve.v1 import gateway_pb2

DRAFTER_KINDS = {DFLASH: pb.DRAFTER_KIND_DFLASH, NGRAM: pb.DRAFTER_KIND_NGRAM,
                 NONE: pb.DRAFTER_KIND_NONE}
FINISH = {pb.FINISH_REASON_STOP: FinishReason.STOP, pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
          pb.FINISH_REASON_ABORT: FinishReason.ABORT}
TRACE_ID_KEY = "x-specserve-trace-id"  # the gateway's initial metadata, when spans are exported


@dataclass(frozen=True)
class Chunk:
    text: str  # the text delta
    token_ids: tuple[int, ...]  # what one verifier step committed
    commit_len: int
    accepted_depth: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked
    tree_size: int = 0  # draft nodes the step verified (0: plain decoding)
    shape: str = ""  # adaptive speculation's choice ("": not adaptive)
    fallback: str = ""  # why the step fell back to root-only ("": it did not)
    why: str = ""  # adaptive speculation's reason for `shape` ("": not adaptive)


@dataclass(frozen=True)
class Final:
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    stats: RequestSpecStats
    other_s: float
    request_id: str
    ttft_s: float
    wall_s: float
    verifier: str = ""  # the replica that served it ("": not known)


def generate_request(prompt: str | list[int], params: SamplingParams, drafter: str | None = None,
                     budget: int | None = None,
                     request_id: str = "") -> gateway_pb2.GenerateRequest:
    """Every sampling value explicit (top_k 0: no cut); clear temperature / top_k / top_p for the
    model's defaults. `drafter` None / `budget` None: the verifier's."""
    sampling = pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                 top_k=params.top_k or 0,
                                 top_p=max(params.top_p, FLOAT32_TINY),  # 0 in float32: none
                                 stop_token_ids=list(params.stop_token_ids),
                                 stop=list(params.stop), ignore_eos=params.ignore_eos,
                                 include_stop_str_in_output=params.include_stop_str_in_output)
    if params.seed is not None:
        sampling.seed = params.seed
    if params.logprobs is not None:
        sampling.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        sampling.prompt_logprobs = params.prompt_logprobs
    msg = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    if drafter is not None:
        msg.spec.drafter = DRAFTER_KINDS[drafter]
    if budget is not None:
        msg.spec.budget = budget
    return msg


def event(msg: gateway_pb2.GenerateResponse) -> Chunk | Final:
    if msg.WhichOneof("event") == "chunk":
        c = msg.chunk
        return Chunk(c.text, tuple(c.token_ids), c.commit_len, c.accepted_depth,
                     logprobs_from_pb(c.logprobs), c.tree_size, c.shape, c.fallback, c.why)
    f, s = msg.final, msg.final.stats
    stats = RequestSpecStats(
        steps=s.steps, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        committed_tokens=s.committed_tokens, commit_len_hist=Counter(s.commit_len_hist),
        accepted_per_position=Counter(s.accepted_per_position), fallbacks=Counter(s.fallbacks),
        shapes=Counter(s.shapes), prefill_s=s.phases.prefill_s, draft_s=s.phases.draft_s,
        verify_s=s.phases.verify_s, commit_s=s.phases.commit_s, device=s.device)
    return Final(FINISH.get(f.finish_reason), f.usage.prompt_tokens, f.usage.completion_tokens,
                 stats, s.phases.other_s, f.request_id, f.ttft_s, f.wall_s, f.verifier)


def logprobs_from_pb(msgs) -> tuple[TokenLogprob, ...]:
    """Repeated TokenLogprob messages (a Chunk's, a VerifyEvent's) as TokenLogprobs."""
    return tuple(TokenLogprob(m.logprob, tuple(m.top_ids), tuple(m.top_logprobs)) for m in msgs)


def trace_id(metadata) -> str | None:
    """The request's trace id from a Generate call's initial metadata (None: not exported)."""
    return next((value for key, value in metadata or () if key == TRACE_ID_KEY), None)
