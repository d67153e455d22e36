"""Drafter wire messages (drafter.proto) to and from the drafter core's types.

The only module of the drafter service that touches pb2 messages: a `DraftBatch` becomes a
`Batch` (its header read at once; `Batch.entries` decodes each `DraftEntry` into a core `Entry`,
its context features straight onto the drafter's device and dtype or read in place from an
attached ring), results become `Tree`s of one `TreeBatch` per step; `Attach`'s RingSpec becomes
a `RingInfo`, its reply is built here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.common.convert import DRAFTER_NAMES, tensor_from_pb
from services.common.ring import RING_UNKNOWN, RingInfo
from services.drafter.core import DraftTimes, Entry, Result
from specserve.drafters.base import DraftRequest
from specserve.errors import InvalidRequest
from specserve.v1 import drafter_pb2 as pb


@dataclass(frozen=True, eq=False)
class Batch:
    """A DraftBatch read: its header in core terms; its entries decoded on demand (`entries`:
    context rows are copied onto the device, so a worker thread does it)."""

    step_id: int
    release: tuple[str, ...]  # requests to release before the entries are drafted
    request_ids: tuple[str, ...]  # the entries', in order
    feed: bool  # a prefill context feed: every entry budget 0, no new history (no tree wanted)
    in_ring: bool  # some entry's rows are read in place from an attached ring
    _msg: pb.DraftBatch = field(repr=False)

    def entries(self, device: torch.device, dtype: torch.dtype,
                rings: dict[int, torch.Tensor] | None = None) -> list[Entry | Exception]:
        """Each entry as a core `Entry`, or the exception that decoding it raised (an entry
        fails alone: InvalidRequest for a malformed one, see `entry_from_pb`)."""
        out: list[Entry | Exception] = []
        for msg in self._msg.entries:
            try:
                out.append(entry_from_pb(msg, device, dtype, rings))
            except Exception as e:  # the caller decides what each one means
                out.append(e)
        return out

    def trace_contexts(self) -> list[dict[str, str]]:
        """Each entry's W3C trace context ({} where the verifier did not trace that step)."""
        return [dict(e.trace_context) for e in self._msg.entries]


def read_batch(msg: pb.DraftBatch) -> Batch:
    entries = msg.entries
    return Batch(step_id=msg.step_id, release=tuple(msg.release),
                 request_ids=tuple(e.request_id for e in entries),
                 feed=bool(entries) and all(e.budget == 0 and not e.new_history
                                            for e in entries),
                 in_ring=any(e.HasField("context_ref") for e in entries), _msg=msg)


def read_batch_bytes(data: bytes) -> Batch:
    """A lane BATCH frame's batch."""
    return read_batch(batch_from_bytes(data))


def drafter_name(kind: int) -> str | None:
    """The core's drafter name of a DrafterKind (None = the server's default)."""
    return DRAFTER_NAMES.get(kind, f"DrafterKind {kind}")


def entry_from_pb(msg: pb.DraftEntry, device: torch.device, dtype: torch.dtype,
                  rings: dict[int, torch.Tensor] | None = None) -> Entry:
    """Raises InvalidRequest for a malformed context tensor (`tensor_from_pb`), or a reference
    to a ring not attached here or to rows outside it (any generation, offset and rows)."""
    context = None
    if msg.HasField("context_ref"):
        context = _ring_rows(msg.context_ref, rings or {}).to(device=device, dtype=dtype)
    elif msg.HasField("context"):
        context = tensor_from_pb(msg.context, device).to(device=device, dtype=dtype)
    request = DraftRequest(request_id=msg.request_id, bonus_token=msg.bonus_token,
                           start=msg.start, budget=msg.budget, max_depth=msg.max_depth,
                           context=context, context_fused=msg.context_fused, chain=msg.chain)
    return Entry(request, drafter_name(msg.drafter), tuple(msg.new_history))


def _ring_rows(ref: pb.ContextRef, rings: dict[int, torch.Tensor]) -> torch.Tensor:
    ring = getattr(rings, "read", rings.get)(ref.generation)  # Rings: noted as used
    if ring is None:
        raise InvalidRequest(f"context ring {ref.generation} {RING_UNKNOWN}")
    if ref.offset < 0 or ref.rows <= 0 or ref.offset + ref.rows > ring.shape[0]:
        raise InvalidRequest(f"context rows [{ref.offset}, {ref.offset + ref.rows}) are "
                             f"outside the ring's {ring.shape[0]}")
    return ring[ref.offset : ref.offset + ref.rows]  # a view: read in place


def ring_from_pb(msg: pb.RingSpec) -> RingInfo:
    """Raises ValueError for an inconsistent spec."""
    cuda = None
    if msg.HasField("cuda"):
        c = msg.cuda
        cuda = (c.device, c.handle, c.size_bytes, c.offset_bytes, c.ref_counter_handle,
                c.ref_counter_offset, c.event_handle, c.event_sync_required)
    return RingInfo(msg.generation, msg.rows, msg.width, msg.dtype, msg.nonce,
                    shm_path=msg.shm_path if msg.HasField("shm_path") else None, cuda=cuda)


def attach_reply_to_pb(attached: bool, ring_error: str | None, lane_path: str | None,
                       lane_token: bytes, max_message_bytes: int = 0) -> pb.AttachReply:
    return pb.AttachReply(ring_attached=attached, ring_error=ring_error or "",
                          lane_path=lane_path or "", lane_token=lane_token,
                          max_message_bytes=max_message_bytes)


def ring_of(msg: pb.AttachRequest) -> pb.RingSpec | None:
    return msg.ring if msg.HasField("ring") else None


def batch_from_bytes(data: bytes) -> pb.DraftBatch:
    return pb.DraftBatch.FromString(data)


def release_from_bytes(data: bytes) -> list[str]:
    return list(pb.ReleaseRequest.FromString(data).request_ids)


def tree_to_pb(request_id: str, result: Result) -> pb.Tree:
    if isinstance(result, str):
        return pb.Tree(request_id=request_id, error=result or "drafting failed")
    return pb.Tree(request_id=request_id, token_ids=result.token_ids.tolist(),
                   parents=result.parents.tolist(), depths=result.depths.tolist(),
                   scores=[] if result.scores is None else result.scores.tolist())


def tree_batch_to_pb(batch: Batch | pb.DraftBatch, results: Sequence[Result],
                     times: DraftTimes | None = None) -> pb.TreeBatch:
    """One tree per entry of `batch`, in order, under the batch's step_id."""
    batch = read_batch(batch) if isinstance(batch, pb.DraftBatch) else batch
    times = times or DraftTimes()
    trees = [tree_to_pb(rid, r) for rid, r in zip(batch.request_ids, results, strict=True)]
    return pb.TreeBatch(step_id=batch.step_id, trees=trees, forward_s=times.forward_s,
                        tree_build_s=times.tree_build_s)


def error_batch_to_pb(batch: Batch, error: str) -> pb.TreeBatch:
    """Every entry of `batch` failed with `error`."""
    return tree_batch_to_pb(batch, [error] * len(batch.request_ids))


def tree_batch_bytes(reply: pb.TreeBatch) -> bytes:
    """A lane TREES frame's payload."""
    return reply.SerializeToString()
