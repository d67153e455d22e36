"""One DraftBatch → one TreeBatch on the drafter: decode, draft, encode, spans and metrics.

Reads no protobuf itself: the batch comes read (`convert.Batch`), the reply goes out through
convert.

Owns what the gRPC stream (servicer.py) and the same-host lane (attach.py) both do with a
batch, so the two transports cannot drift: entries are decoded (context rows from the message,
or read in place from an attached ring; an entry that fails to decode fails alone), the core
drafts, the trees go back under the batch's step id, and each traced entry gets its
`draft.forward` / `ddtree.build` (or `ngram.draft`) spans, timed by the batch's measurements.
Runs in whatever thread calls it (a worker thread for the stream, the lane's own thread).
`Rings` holds the attached rings and which to drop (attach.py fills it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from opentelemetry.trace import Status, StatusCode

from services.common import telemetry
from services.common.errors import status_for
from services.drafter import convert
from services.drafter.core import DFLASH, DrafterCore, DraftTimes, Entry, Result
from specserve.errors import InvalidRequest, SpecServeError
from specserve.v1 import drafter_pb2

log = logging.getLogger(__name__)


def error_text(error: BaseException) -> str:
    """An error string for a Tree: the status code name the table gives, then the message."""
    return f"{status_for(error).name}: {error}"


class Rings(dict):
    """Mapped context rings by generation (`[rows, width]` views), when each was last read or
    attached (`used`, monotonic seconds) and a CPU ring's shared file (`paths`)."""

    def __init__(self) -> None:
        super().__init__()
        self.used: dict[int, float] = {}
        self.paths: dict[int, str] = {}

    def read(self, generation: int) -> torch.Tensor | None:
        ring = self.get(generation)
        if ring is not None:
            self.used[generation] = time.monotonic()
        return ring

    def hold(self, generation: int, view: torch.Tensor, path: str | None,
             most: int) -> list[int]:
        """Hold a ring; drop those whose shared file is gone (their verifier exited), then the
        least recently used past `most`. Returns the generations dropped."""
        self[generation], self.used[generation] = view, time.monotonic()
        if path is not None:
            self.paths[generation] = path
        gone = [g for g, p in self.paths.items() if not os.path.exists(p)]
        while len(self) - len(gone) > most:
            gone.append(min((g for g in self if g not in gone),
                            key=lambda g: self.used.get(g, 0.0)))
        for gen in gone:
            self.pop(gen, None)
            self.used.pop(gen, None)
            self.paths.pop(gen, None)
        return gone


class BatchRunner:
    """Runs batches against `core`; `rings` maps a ring generation to its `[rows, width]`
    view (attach.py fills it)."""

    def __init__(self, metrics=None) -> None:
        self.metrics = metrics  # DrafterMetrics | None
        self.rings = Rings()
        self._tracer = telemetry.tracer("specserve.drafter")

    def reply(self, core: DrafterCore, batch: convert.Batch, owner: object = None
              ) -> tuple[drafter_pb2.TreeBatch, Callable[[], None] | None]:
        """The batch's TreeBatch (every entry failed with the error when the core refuses the
        whole batch) and what records its spans and metrics (None then): call it once the
        reply is sent, so the verifier does not wait for them. `owner`: the connection the
        batch came on."""
        try:
            results, times, record = self.run(core, batch, owner)
        except SpecServeError as e:
            return convert.error_batch_to_pb(batch, error_text(e)), None
        return convert.tree_batch_to_pb(batch, results, times), record

    def run(self, core: DrafterCore, batch: convert.Batch, owner: object = None
            ) -> tuple[list[Result], DraftTimes, Callable[[], None]]:
        """Decode the entries, draft (an entry that fails to decode, for whatever reason, fails
        alone): the results, their times and what records the spans and metrics. Raises what
        the core raises for the whole batch (SpecServeError)."""
        t0 = time.perf_counter()
        device = core.context_device
        entries = [self._decoded(rid, e) for rid, e in zip(
            batch.request_ids, batch.entries(device, core.context_dtype, self.rings),
            strict=True)]
        results, times = core.draft_timed(entries, owner)
        if batch.in_ring and device.type == "cuda":  # every ring read done before the reply
            torch.cuda.current_stream(device).synchronize()
        batch_s = time.perf_counter() - t0
        return results, times, lambda: self._record(core, batch, results, times, batch_s)

    def observe_cache(self, core: DrafterCore) -> None:
        """The context cache's page gauges (after a batch or a release)."""
        if self.metrics is not None:
            self.metrics.set_cache_pages(core.cache_pages())

    @staticmethod
    def _decoded(request_id: str, entry: Entry | Exception) -> Entry | str:
        """The entry, or why it fails alone: an InvalidRequest's message, or for anything else
        (say the device out of memory) a generic error, the details only in the log."""
        if isinstance(entry, InvalidRequest):
            return error_text(entry)
        if isinstance(entry, Exception):
            log.error("decoding the entry of request %r failed", request_id, exc_info=entry)
            return f"INTERNAL: the entry of request {request_id!r} could not be decoded"
        return entry

    def _record(self, core: DrafterCore, batch, results: Sequence[Result], times: DraftTimes,
                batch_s: float) -> None:
        self.observe_cache(core)
        self._spans(batch, results, times)
        if self.metrics is not None and batch.feed:
            self.metrics.feeds.inc(len(batch.request_ids))
        elif self.metrics is not None:
            self._metrics(results, times, batch_s)

    def _spans(self, batch: convert.Batch, results: Sequence[Result],
               times: DraftTimes) -> None:
        contexts = batch.trace_contexts()
        if not any(contexts):
            return
        for g in times.groups:
            forward_end = g.start_ns + int(g.forward_s * 1e9)
            tree_end = forward_end + int(g.tree_build_s * 1e9)
            for i in g.indices:
                if not contexts[i]:
                    continue
                parent = telemetry.extract_map(contexts[i])
                attrs = {"request.id": batch.request_ids[i], "drafter": g.kind,
                         "batch.entries": len(batch.request_ids), "batch.step_id": batch.step_id}
                if g.kind == DFLASH:
                    self._span("draft.forward", parent, attrs, g.start_ns, forward_end)
                    self._span("ddtree.build", parent, attrs, forward_end, tree_end,
                               results[i])
                else:
                    self._span(f"{g.kind}.draft", parent, attrs, g.start_ns, tree_end,
                               results[i])

    def _span(self, name, parent, attrs, start_ns: int, end_ns: int,
              result: Result | None = None) -> None:
        span = self._tracer.start_span(name, parent, attributes=attrs, start_time=start_ns)
        if isinstance(result, str):
            span.set_status(Status(StatusCode.ERROR, result))
        elif result is not None:
            span.set_attribute("tree_size", result.n)
        span.end(end_time=max(start_ns, end_ns))

    def _metrics(self, results: Sequence[Result], times: DraftTimes, batch_s: float) -> None:
        m = self.metrics
        m.batches.inc()
        m.batch_seconds.observe(batch_s)
        drafted = set()
        for g in times.groups:
            if g.forward_s:
                m.phase.labels(phase="forward").observe(g.forward_s)
            m.phase.labels(phase="tree_build").observe(g.tree_build_s)
            for i in g.indices:
                drafted.add(i)
                ok = "error" if isinstance(results[i], str) else "ok"
                m.entries.labels(drafter=g.kind, result=ok).inc()
        for i, result in enumerate(results):
            if i not in drafted:  # rejected before drafting, or drafter "none"
                ok = "error" if isinstance(result, str) else "ok"
                m.entries.labels(drafter="none", result=ok).inc()
