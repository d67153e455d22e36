"""CUDA graphs of the decode / verify forward: one graph per (requests, rows each) bucket.

Owns the padded, static form of a step whose inputs are all trees (verify, or an AR decode's one
root row): B requests become `Bb` (a batch bucket) and each request's rows become `nb` (a rows
bucket ≥ its tree). Pad rows sit at the positions right after the request's tree — in its pages as
far as its scratch reservation goes (the engine ensures them up to start + nb), on the trash page
(the pool's extra last page, never handed out) past it — see only themselves and are seen by nobody;
missing requests are dummies on the trash page. The attention plan is made for the longest context a
graph replays at (a fixed split count, device-side ranges): one graph per bucket for steps whose
contexts are all ≤ SHORT_CONTEXT and one for the rest (planned for `max_model_len`) — at short
contexts the kernel is latency-bound and wants its own split count and row blocks (BENCHMARKS.md,
"Tree-verify kernel — row-block and engine-tree sweeps", run 7, and "Figures formerly in source
comments"). A step's metadata goes to the device in one copy of a pinned staging buffer into the
graph's static buffer, then the graph replays: no per-layer Python, no launches.

`capture=False` runs the same padded static path eagerly — the CPU twin the tests compare with
the unpadded forward.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from specserve.attention.base import AttnBatch
from specserve.cudagraph import BATCH_BUCKETS, Staging, bucket_of, capture_graph, planned_for
from specserve.kernels.tree_attention.configs import (
    SHORT_CONTEXT,  # the kernel's latency-bound plans
)


def row_buckets(max_rows: int) -> list[int]:
    """Rows-per-request buckets: 1, 2, 3, 4, 5, 8, 9, 16, 17, … (2^k and 2^k + 1: a budget-B
    tree has B + 1 rows), capped by `max_rows` (the scratch a request reserves)."""
    out = {max_rows}
    for k in range(11):
        out.update(b for b in (1 << k, (1 << k) + 1) if b < max_rows)
    return sorted(out)


@dataclass(eq=False)
class _Static:
    """One bucket's buffers, its batch and outputs."""

    bb: int
    nb: int
    buf: Staging
    batch: AttnBatch
    graph: object = None  # torch.cuda.CUDAGraph, or None (eager)
    logits: torch.Tensor | None = None  # [bb·nb, V] float32 (graph output)
    feats: torch.Tensor | None = None  # [bb·nb, taps·hidden] (graph output)

    @property
    def views(self) -> dict:
        return self.buf.views


class StepGraphs:
    """Padded static decode / verify forwards of `model` over `kv`, captured lazily per bucket."""

    def __init__(self, model, kv, page_size: int, max_model_len: int, max_rows: int,
                 trash_page: int, capture: bool | None = None) -> None:
        self.model, self.kv, self.page_size = model, kv, page_size
        self.max_model_len, self.trash_page = max_model_len, trash_page
        self.short_context = SHORT_CONTEXT
        self.rows = row_buckets(max_rows)
        self.device = kv.kv.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_pages = -(-(max_model_len + max_rows) // page_size)
        self._graphs: dict[tuple, _Static] = {}
        self._pool = None
        self.builds = 0  # graphs built so far: a step that built one timed its capture

    def padded_rows(self, n: int) -> int:
        """Rows a request's tree of `n` rows occupies in the graph path (pages must cover)."""
        return bucket_of(n, self.rows) or n

    def fits(self, inputs) -> bool:
        return (all(x.tree_mask is not None for x in inputs) and len(inputs) <= BATCH_BUCKETS[-1]
                and max(len(x.token_ids) for x in inputs) <= self.rows[-1])

    def run(self, inputs, page_tables: Seq[Seq[int]], logit_rows: Seq[int],
            taps: Seq[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits `[len(logit_rows), V]` float32 and (when `taps`) features of every real row."""
        nb = bucket_of(max(len(x.token_ids) for x in inputs), self.rows)
        bb = bucket_of(len(inputs), BATCH_BUCKETS)
        key = (bb, nb, tuple(taps), self.context_class(max(x.ctx_len for x in inputs)))
        st = self._graphs.get(key) or self._build(*key)
        st.buf.wait()
        real = self._fill(st, inputs, page_tables, np.asarray(logit_rows, dtype=np.int64))
        st.buf.push()
        logits, feats = self._replay(st, tuple(taps))
        sel = st.views["select"][0]
        out = logits.index_select(0, sel[: len(logit_rows)])
        if feats is None:
            return out, None
        return out, feats.index_select(0, sel[len(logit_rows) : len(logit_rows) + real])

    def context_class(self, ctx: int) -> int:
        """The longest context of the graphs a step with longest context `ctx` replays."""
        short = self.short_context
        return short if ctx <= short < self.max_model_len else self.max_model_len

    def warm(self, bb: int, taps: Seq[int], rows: Seq[int] | None = None) -> int:
        """Capture every rows bucket (or those of trees of `rows` rows) × context class of
        batch bucket `bb` not captured yet (so the first step of a kind does not capture inside
        a request). Returns how many."""
        buckets = self.rows if rows is None else sorted({self.padded_rows(n) for n in rows})
        keys = [(bb, nb, tuple(taps), cls) for nb in buckets
                for cls in sorted({self.context_class(0), self.max_model_len})]
        todo = [k for k in keys if k not in self._graphs]
        for key in todo:
            self._build(*key)
        return len(todo)

    # ---- buffers ---------------------------------------------------------------------------
    def _build(self, bb: int, nb: int, taps: tuple, max_ctx: int) -> _Static:
        words = -(-nb // 32)
        spec = {"cu": ((bb + 1,), np.int32), "ctx": ((bb,), np.int32),
                "table": ((bb, self.max_pages), np.int32), "slots": ((bb * nb,), np.int64),
                "pos": ((bb * nb,), np.int64), "mask": ((bb * nb, words), np.int32),
                "ids": ((bb * nb,), np.int64), "select": ((2 * bb * nb,), np.int64)}
        buf = Staging(spec, self.device)
        buf.views["cu"][1][:] = np.arange(bb + 1, dtype=np.int32) * nb
        d = {k: v[0] for k, v in buf.views.items()}
        batch = AttnBatch(q_lens=(nb,) * bb, ctx_lens=(max_ctx,) * bb, cu_q=d["cu"],
                          ctx_lens_t=d["ctx"], block_table=d["table"], slot_mapping=d["slots"],
                          positions=d["pos"], tree_mask=d["mask"], page_size=self.page_size)
        st = _Static(bb, nb, buf, batch)
        self.builds += 1
        self._fill(st, [], [], np.zeros(0, np.int64))  # all dummies: safe to run
        buf.push()
        if self.capture:
            self._capture(st, taps, max_ctx)
        self._graphs[(bb, nb, taps, max_ctx)] = st
        return st

    def _fill(self, st: _Static, inputs, page_tables, logit_rows: np.ndarray) -> int:
        """Write the padded step into the host views; returns the number of real rows."""
        v = {k: h for k, (_, h) in st.views.items()}
        nb, ps, trash = st.nb, self.page_size, self.trash_page
        v["table"][:] = trash
        v["ctx"][:] = 0
        v["ids"][:] = 0
        v["pos"].reshape(st.bb, nb)[:] = np.arange(nb)
        v["slots"].reshape(st.bb, nb)[:] = trash * ps + np.arange(nb) % ps
        v["mask"][:] = 0
        diag = np.arange(st.bb * nb) % nb  # every row sees itself
        v["mask"][np.arange(st.bb * nb), diag // 32] = (1 << (diag % 32)).astype(np.uint32).view(
            np.int32)
        real = []
        for i, (x, table) in enumerate(zip(inputs, page_tables, strict=True)):
            n, r0, ctx = len(x.token_ids), i * nb, x.ctx_len
            table = np.asarray(table)  # once: a list of thousands of pages is slow to convert
            v["table"][i, : len(table)] = table
            v["ctx"][i] = ctx
            pos = np.arange(ctx, ctx + nb)  # K/V slots: tree rows, then pad rows after them
            page = pos // ps  # past its pages (a smaller budget's scratch): the trash page
            page = np.where(page < len(table), table[np.minimum(page, len(table) - 1)], trash)
            v["slots"][r0 : r0 + nb] = page.astype(np.int64) * ps + pos % ps
            v["pos"][r0 : r0 + nb] = ctx  # pad rows sit at the root's position (RoPE, window)
            v["pos"][r0 : r0 + n] = np.asarray(x.positions, dtype=np.int64)
            v["ids"][r0 : r0 + n] = np.asarray(x.token_ids, dtype=np.int64)
            m = np.asarray(x.tree_mask, dtype=np.uint32).view(np.int32)
            v["mask"][r0 : r0 + n] = 0
            v["mask"][r0 : r0 + n, : m.shape[1]] = m
            real.append(r0 + np.arange(n))
        flat = np.concatenate(real) if real else np.zeros(0, np.int64)
        v["select"][: len(logit_rows)] = flat[logit_rows]
        v["select"][len(logit_rows) : len(logit_rows) + len(flat)] = flat
        return len(flat)

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, st: _Static, taps: tuple, batch: AttnBatch | None = None):
        hidden, feats = self.model(st.views["ids"][0], batch or st.batch, self.kv, taps)
        return self.model.logits(hidden), feats

    @torch.inference_mode()
    def _capture(self, st: _Static, taps: tuple, max_ctx: int) -> None:
        with planned_for(self.model, max_ctx):
            st.graph, (st.logits, st.feats), self._pool = capture_graph(
                partial(self._forward, st, taps), self.device, self._pool)

    @torch.inference_mode()
    def _replay(self, st: _Static, taps: tuple):
        if st.graph is None:  # eager: backends that read host ctx_lens get the real ones
            ctx = tuple(int(c) for c in st.views["ctx"][1])
            return self._forward(st, taps, replace(st.batch, ctx_lens=ctx, memo={}))
        st.graph.replay()
        return st.logits, st.feats
