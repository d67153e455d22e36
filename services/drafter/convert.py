"""Drafter wire messages (drafter.proto) to and from the drafter core's types.

The only module of the drafter service that touches pb2 messages: a `DraftEntry` becomes a core
`Entry` (its context features decoded straight onto the drafter's device and dtype), results
become `Tree`s of one `TreeBatch` per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.convert import DRAFTER_NAMES, tensor_from_pb
from services.drafter.core import DraftTimes, Entry, Result
from specserve.drafters.base import DraftRequest
from specserve.v1 import drafter_pb2 as pb


def drafter_name(kind: int) -> str | None:
    """The core's drafter name of a DrafterKind (None = the server's default)."""
    return DRAFTER_NAMES.get(kind, f"DrafterKind {kind}")


def entry_from_pb(msg: pb.DraftEntry, device: torch.device, dtype: torch.dtype) -> Entry:
    """Raises InvalidRequest for a malformed context tensor."""
    context = None
    if msg.HasField("context"):
        context = tensor_from_pb(msg.context, device).to(device=device, dtype=dtype)
    request = DraftRequest(request_id=msg.request_id, bonus_token=msg.bonus_token,
                           start=msg.start, budget=msg.budget, max_depth=msg.max_depth,
                           context=context)
    return Entry(request, drafter_name(msg.drafter), tuple(msg.new_history))


def tree_to_pb(request_id: str, result: Result) -> pb.Tree:
    if isinstance(result, str):
        return pb.Tree(request_id=request_id, error=result or "drafting failed")
    return pb.Tree(request_id=request_id, token_ids=result.token_ids.tolist(),
                   parents=result.parents.tolist(), depths=result.depths.tolist())


def tree_batch_to_pb(batch: pb.DraftBatch, results: Sequence[Result],
                     times: DraftTimes | None = None) -> pb.TreeBatch:
    """One tree per entry of `batch`, in order, under the batch's step_id."""
    times = times or DraftTimes()
    trees = [tree_to_pb(e.request_id, r) for e, r in zip(batch.entries, results, strict=True)]
    return pb.TreeBatch(step_id=batch.step_id, trees=trees, forward_s=times.forward_s,
                        tree_build_s=times.tree_build_s)


def error_batch_to_pb(batch: pb.DraftBatch, error: str) -> pb.TreeBatch:
    """Every entry of `batch` failed with `error`."""
    return tree_batch_to_pb(batch, [error] * len(batch.entries))


def trace_contexts(batch: pb.DraftBatch) -> list[dict[str, str]]:
    """Each entry's W3C trace context ({} where the verifier did not trace that step)."""
    return [dict(e.trace_context) for e in batch.entries]


def request_ids(batch: pb.DraftBatch) -> list[str]:
    return [e.request_id for e in batch.entries]


def release_ids(msg: pb.ReleaseRequest) -> list[str]:
    return list(msg.request_ids)


def is_feed(batch: pb.DraftBatch) -> bool:
    """A prefill context feed: every entry budget 0 with no new history (no tree wanted)."""
    return bool(batch.entries) and all(e.budget == 0 and not e.new_history
                                       for e in batch.entries)
