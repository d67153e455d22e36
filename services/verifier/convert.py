"""Verifier wire conversions: VerifyRequest/VerifyEvent/StatsReply and the drafter stream's
DraftBatch/TreeBatch/Release messages to and from core types.

With services/common/convert.py, the only verifier module that touches pb2 messages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from services.common.convert import (
    DRAFTER_NAMES,
    check_stop,
    finish_to_pb,
    logprobs_to_pb,
    sampling_from_pb,
    spec_stats_to_pb,
    tensor_to_pb,
)
from specserve.drafters.base import DraftRequest
from specserve.errors import InvalidRequest, check_request_id
from specserve.spec.tree import DraftTree, check_trees
from specserve.types import SamplingParams
from specserve.v1 import common_pb2, drafter_pb2, verifier_pb2

DRAFTER_KINDS = {name: kind for kind, name in DRAFTER_NAMES.items()}  # "ngram" -> pb enum


@dataclass(frozen=True)
class SpecLimits:
    """What the server allows: budgets are capped at `max_draft_tokens`; no drafter → 0."""

    default_budget: int
    max_draft_tokens: int
    has_drafter: bool
    sampling_defaults: object = None  # the model's GenerationDefaults (None: greedy)


@dataclass(frozen=True)
class GenerateArgs:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    budget: int  # what the engine gets: `asked_budget` capped, 0 without a drafter
    drafter_kind: str | None  # "dflash" | "ngram" | None (the drafter's default)
    asked_budget: int = 0  # the request's budget, else the server's default
    capped: bool = False  # --max-draft-tokens cut `asked_budget` to `budget`


def generate_args_from_pb(msg: verifier_pb2.VerifyRequest, limits: SpecLimits,
                          fallback_id: str) -> GenerateArgs:
    """Raises InvalidRequest for bad sampling parameters (a stop list over the default bounds
    included), a negative budget or a bad kind. A budget over `max_draft_tokens` is capped
    there (`GenerateArgs.capped`; the gateway already refused one over MAX_BUDGET); the engine
    checks the capped one against its own bound."""
    params = sampling_from_pb(msg.sampling, limits.sampling_defaults)
    check_stop(params.stop)
    if msg.spec.drafter not in DRAFTER_NAMES:
        raise InvalidRequest(f"unknown drafter kind {msg.spec.drafter}")
    kind = DRAFTER_NAMES[msg.spec.drafter]
    asked = msg.spec.budget if msg.spec.HasField("budget") else limits.default_budget
    if asked < 0:
        raise InvalidRequest(f"budget must be >= 0, got {asked}")
    speculates = kind != "none" and limits.has_drafter
    return GenerateArgs(
        request_id=check_request_id(msg.request_id) if msg.request_id else fallback_id,
        prompt_ids=list(msg.prompt_ids),  # ints already
        params=params,
        budget=min(asked, limits.max_draft_tokens) if speculates else 0,
        drafter_kind=None if kind == "none" else kind,
        asked_budget=asked,
        capped=speculates and asked > limits.max_draft_tokens,
    )


def step_event_to_pb(token_ids, step) -> verifier_pb2.VerifyEvent:
    """One step's event; `step` is its StepRecord (None for the token sampled by prefill)."""
    event = verifier_pb2.VerifyEvent(token_ids=list(token_ids), commit_len=len(token_ids))
    if step is not None:
        event.commit_len = step.commit_len
        event.accepted_depth = step.accepted_depth
        event.tree_size = step.tree_size
        event.budget = step.budget
        event.fallback = step.fallback or ""
        event.shape = step.shape or ""
        event.why = step.why or ""
    return event


def verify_event_to_pb(item, wall_s: float) -> verifier_pb2.VerifyEvent:
    """A request's `StepEvent` (services/verifier/loop.py): its step, and on the last one the
    final (`wall_s`: the request's time so far)."""
    event = step_event_to_pb(item.output.new_token_ids, item.step)
    logprobs_to_pb(item.output.logprobs, event.logprobs)
    logprobs_to_pb(item.output.prompt_logprobs, event.prompt_logprobs)
    if item.output.finished:
        final_to_pb(event, item.output, item.stats, wall_s)
    return event


def final_to_pb(event: verifier_pb2.VerifyEvent, output, stats, wall_s: float) -> None:
    """Fill `event.final` from the last RequestOutput and the request's RequestSpecStats."""
    event.final.finish_reason = finish_to_pb(output.finish_reason)
    event.final.usage.CopyFrom(common_pb2.Usage(prompt_tokens=output.num_prompt_tokens,
                                                completion_tokens=output.num_output_tokens))
    if stats is not None:
        phases = stats.prefill_s + stats.draft_s + stats.verify_s + stats.commit_s
        event.final.stats.CopyFrom(spec_stats_to_pb(stats, other_s=max(0.0, wall_s - phases)))


def stats_to_pb(stats, drafter_connected: bool, transport: str = "",
                context_rows: dict[str, int] | None = None,
                profile: dict[str, float] | None = None,
                cost_ms: dict[str, float] | None = None) -> verifier_pb2.StatsReply:
    return verifier_pb2.StatsReply(drafter_transport=transport, context_rows=context_rows or {},
        profile=profile or {}, cost_ms=cost_ms or {},
        kv_pages_used=stats.pages_used, kv_pages_free=stats.pages_free,
        kv_pages_reserved=stats.pages_reserved, preempted=stats.preempted,
        kv_pages_total=stats.pages_total, active_requests=stats.active,
        waiting_requests=stats.waiting, drafter_connected=drafter_connected,
        fallbacks=dict(stats.fallbacks), steps=stats.steps, max_model_len=stats.max_model_len)


# ---- the drafter stream ----------------------------------------------------------------------
def add_draft_entry(batch: drafter_pb2.DraftBatch, req: DraftRequest, kind: str | None,
                    context: torch.Tensor | None, new_history,
                    trace_context: dict[str, str] | None = None,
                    fused: bool = False) -> drafter_pb2.DraftEntry:
    """Append the request's entry to `batch`, its context rows (if any; `fused`: fc-projected)
    written in place (a prefill chunk's rows are 8-336 MB: a submessage copied into the batch
    would copy them again)."""
    entry = batch.entries.add(
        request_id=req.request_id, drafter=DRAFTER_KINDS.get(kind, 0),
        bonus_token=req.bonus_token, start=req.start, budget=req.budget,
        max_depth=req.max_depth, new_history=[int(t) for t in new_history],
        trace_context=trace_context or {}, chain=req.chain)
    if context is not None and context.shape[0]:
        fill_context(entry, context, fused)
    return entry


def draft_batch(step_id: int = 0) -> drafter_pb2.DraftBatch:
    """An empty DraftBatch; `add_draft_entry` fills it."""
    return drafter_pb2.DraftBatch(step_id=step_id)


def release_to_pb(request_ids) -> drafter_pb2.ReleaseRequest:
    """A lane RELEASE frame's message."""
    return drafter_pb2.ReleaseRequest(request_ids=sorted(request_ids))


def release_batch(request_ids) -> drafter_pb2.DraftBatch:
    """A release-only batch for the stream (step id 0: its reply is not waited for)."""
    return drafter_pb2.DraftBatch(step_id=0, release=sorted(request_ids))


# a Tree message's node arrays and their dtypes (DraftTree's)
FIELDS = (("token_ids", np.int64), ("parents", np.int32), ("depths", np.int32),
          ("scores", np.float32))


def trees_from_pb(reply: drafter_pb2.TreeBatch) -> dict[str, DraftTree | str]:
    """request id → its DraftTree, or the reason it has none (the entry's error). The trees
    of one shape (all four arrays of one length; scores or not) are read into flat arrays and
    checked at once (`spec.tree.check_trees`); any other is checked alone."""
    out: dict[str, DraftTree | str] = dict.fromkeys(t.request_id for t in reply.trees)  # order
    groups: dict[bool, list] = {True: [], False: []}  # with scores / without
    for tree in reply.trees:
        n, with_scores = len(tree.token_ids), len(tree.scores) > 0
        if tree.error:
            out[tree.request_id] = tree.error
        elif len(tree.parents) == n and len(tree.depths) == n and len(tree.scores) in (0, n):
            groups[with_scores].append(tree)
        else:
            out[tree.request_id] = (
                "malformed tree: token_ids, parents, depths and scores must have equal lengths, "
                f"got {n}, {len(tree.parents)}, {len(tree.depths)}, {len(tree.scores)}")
    for with_scores, trees in groups.items():
        if not trees:
            continue
        flat = [np.fromiter(itertools.chain.from_iterable(getattr(t, f) for t in trees), dtype)
                for f, dtype in FIELDS[: 4 if with_scores else 3]]
        got = check_trees([len(t.token_ids) for t in trees], *flat)
        for tree, g in zip(trees, got, strict=True):
            out[tree.request_id] = g if isinstance(g, DraftTree) else f"malformed tree: {g}"
    return out


def attach_to_pb(ring) -> drafter_pb2.AttachRequest:
    """An AttachRequest offering `ring` (a services.common.ring.RingInfo; None: no ring)."""
    if ring is None:
        return drafter_pb2.AttachRequest()
    spec = drafter_pb2.RingSpec(generation=ring.generation, rows=ring.rows, width=ring.width,
                                dtype=ring.dtype, nonce=ring.nonce)
    if ring.shm_path is not None:
        spec.shm_path = ring.shm_path
    else:
        (spec.cuda.device, spec.cuda.handle, spec.cuda.size_bytes, spec.cuda.offset_bytes,
         spec.cuda.ref_counter_handle, spec.cuda.ref_counter_offset, spec.cuda.event_handle,
         spec.cuda.event_sync_required) = ring.cuda
    return drafter_pb2.AttachRequest(ring=spec)


def attachment_from_pb(reply: drafter_pb2.AttachReply
                       ) -> tuple[bool, str, str | None, bytes, int]:
    return (reply.ring_attached, reply.ring_error, reply.lane_path or None, reply.lane_token,
            reply.max_message_bytes)


def fill_context(entry: drafter_pb2.DraftEntry, rows: torch.Tensor, fused: bool) -> None:
    """The entry's context rows inline (`fused`: fc-projected), written in place."""
    tensor_to_pb(rows, into=entry.context)
    entry.context_fused = fused


def set_context_ref(entry: drafter_pb2.DraftEntry, generation: int, offset: int,
                    rows: int) -> None:
    entry.context_ref.generation, entry.context_ref.offset = generation, offset
    entry.context_ref.rows = rows


def tree_batch_from_bytes(data: bytes) -> drafter_pb2.TreeBatch:
    return drafter_pb2.TreeBatch.FromString(data)


def release_bytes(request_ids) -> bytes:
    return release_to_pb(request_ids).SerializeToString()
