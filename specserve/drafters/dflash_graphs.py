"""CUDA graphs of the DFlash drafter's block forward: one graph per (requests bucket, block length).

Owns the padded, static form of a draft call — the context K/V write of the call's new context
rows (up to `context_rows` = block size per request: a decode step's accepted tokens), then the
block forward: embeddings of `[bonus, mask × (n−1)]`, every layer's block K/V write and block
attention over the paged context, the final norm and the logits of the mask slots — so a draft
step replays one graph instead of launching ~40 kernels per layer from Python (eager, a draft
step was mostly host work around its GPU work: BENCHMARKS.md, "DFlash draft step on the H200 — a
fused drafter path, tried and reverted"). Calls with more new
rows (prefill chunks) write their context eagerly first; the graph's context rows then all go
to the trash page. A call whose requests have different block lengths (one near its max_tokens
has a shorter block) replays the graph of its longest, each shorter block masked to its own
length in the bidirectional layers (causal ones never look ahead): `run`'s `valid`.

Per step the metadata of every (layer group, causality) block batch — context lengths, page
tables, block slots and positions — and the block ids go to the device in one copy of a pinned
staging buffer into the graph's static buffers; missing requests are dummies on a trash page of
each group (taken from its free pages for good). The attention plan is made for the group's
capacity (a fixed split count, device-side ranges), so one graph replays at every context.
`capture=False` runs the same static path eagerly — the CPU twin the tests compare with the
drafter's dynamic path.

With `tables` the graph also computes the DDTree's per-depth top-k tables of its logits (the
log-sum-exp, the top `tables` log-probs and ids, packed: spec/ddtree.py `pack_tables`) and a
replay copies the call's rows to one pinned host buffer, so a draft's tree stage is one sync and
the host's heap, not a dozen launches after the replay (`host_tables`).
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from specserve.attention.base import AttnBatch
from specserve.cudagraph import BATCH_BUCKETS, Staging, bucket_of, capture_graph, planned_for
from specserve.drafters.dflash_cache import DFlashContextCache
from specserve.drafters.dflash_step import CacheStep, block_mask
from specserve.spec.ddtree import pack_tables


class _Static:
    """One bucket's buffers (host views → device views), batches and graph."""

    def __init__(self, graphs: DraftGraphs, bb: int, n: int) -> None:
        self.bb, self.n = bb, n
        c = graphs.context_rows
        spec = {"ids": ((bb * n,), np.int64), "pos": ((bb * n,), np.int64),
                "cu": ((bb + 1,), np.int32), "cpos": ((bb * c,), np.int64)}
        for g in graphs.cache.groups.values():
            spec[f"cflat_{g.name}"] = ((2 * len(g.layers) * bb * c,), np.int64)
            spec[f"ctx_{g.name}"] = ((bb,), np.int32)
            spec[f"table_{g.name}"] = ((bb, graphs.max_pages[g.name]), np.int32)
            spec[f"slots_{g.name}"] = ((bb * n,), np.int64)
            if not all(graphs.causal[i] for i in g.layers):  # a bidirectional layer
                spec[f"mask_{g.name}"] = ((bb * n, -(-n // 32)), np.int32)
        self.buf = Staging(spec, graphs.device)
        self.views = self.buf.views
        self.feats = graphs.feats(bb)  # [bb·C, taps·hidden], one per bucket (replays are serial)
        self.views["cu"][1][:] = np.arange(bb + 1, dtype=np.int32) * n
        self.masks = {}  # group → (window, every request's full block mask [bb·n, W] int32)
        self.batches = {key: self._batch(graphs, *key) for key in graphs.batch_keys}
        self.graph, self.logits, self.packed = None, None, None

    def _batch(self, graphs: DraftGraphs, group: str, causal: bool) -> AttnBatch:
        d = {k: v[0] for k, v in self.views.items()}
        g = graphs.cache.groups[group]
        if not causal:  # bidirectional block (windowed in sliding groups): a static mask, in
            # the host view so that every staging copy carries it
            full = np.tile(block_mask(self.n, g.window).view(np.int32), (self.bb, 1))
            self.masks[group] = (g.window, full)
            self.views[f"mask_{group}"][1][:] = full
        return AttnBatch(q_lens=(self.n,) * self.bb, ctx_lens=(graphs.capacity[group],) * self.bb,
                         cu_q=d["cu"], ctx_lens_t=d[f"ctx_{group}"],
                         block_table=d[f"table_{group}"], slot_mapping=d[f"slots_{group}"],
                         positions=d["pos"], tree_mask=None if causal else d[f"mask_{group}"],
                         page_size=g.page_size)


class DraftGraphs:
    """Padded static block forwards of a `DFlashDrafter`'s model over its context cache."""

    def __init__(self, model, cache: DFlashContextCache, capture: bool | None = None,
                 fused: bool = False, tables: int | None = None) -> None:
        if tables is not None and tables < 1:
            raise ValueError(f"tables must be >= 1 (or None), got {tables}")
        self.model, self.cache, self.device = model, cache, cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.causal = model.config.causal
        self.trash = {}
        for g in cache.groups.values():  # a page per group no request ever gets
            self.trash[g.name] = heapq.heappop(g.free)
        self.capacity = {g.name: g.pool.num_pages * g.page_size for g in cache.groups.values()}
        self.context_rows = model.config.block_size  # new context rows per request in a graph
        self.max_pages = {g.name: g.pool.num_pages for g in cache.groups.values()}
        self.batch_keys = sorted({(cache.group_of[i].name, self.causal[i])
                                  for i in range(model.config.num_layers)})
        # `fused`: the block forward as the target's fused layers (models/fused_layer.py: Triton
        # kernels on CUDA, their torch twins elsewhere) where they cover every layer; the
        # drafter's default (BENCHMARKS.md, "The DFlash block forward as fused layers"). The
        # CPU twin is tested against the module path, the captured kernels on a GPU.
        self.fused = fused and all(model.fused_covers(g.pool.shape.dtype)
                                   for g in cache.groups.values())
        self._graphs: dict[tuple[int, int], _Static] = {}
        # `tables`: top-k columns computed in each replay (None: logits only); the host copy of
        # a call's packed rows [rows, 2 · tables] int32 (pinned on CUDA) and its event
        self.tables = None if tables is None else min(tables, model.config.vocab_size)
        rows, pin = BATCH_BUCKETS[-1] * (model.config.block_size - 1), self.device.type == "cuda"
        self._host = None if tables is None else torch.zeros(rows, 2 * self.tables,
                                                             dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if self._host is not None and pin else None
        self._rows = 0  # rows of the last call's tables in `_host`
        self._feats: dict[int, torch.Tensor] = {}
        self._pool = None

    def feats(self, bb: int) -> torch.Tensor:
        """Batch bucket `bb`'s static context rows `[bb · context_rows, taps · hidden]`, shared
        by its graphs of every block length (a replay fills the rows it writes)."""
        if bb not in self._feats:
            fc = self.model.fc.weight
            self._feats[bb] = torch.zeros(bb * self.context_rows, fc.shape[1], dtype=fc.dtype,
                                          device=self.device)
        return self._feats[bb]

    def warm(self, max_batch: int) -> int:
        """Build (on CUDA: capture) the graph of every batch bucket up to `max_batch` requests
        and every block length not built yet, so that no step builds one inside a request (a
        batch's longest block shrinks in its last steps before max_tokens). Returns how many."""
        top = bucket_of(min(max_batch, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
        keys = [(bb, n) for bb in BATCH_BUCKETS if bb <= top
                for n in range(2, self.model.config.block_size + 1)]
        todo = [k for k in keys if k not in self._graphs]
        for key in todo:
            self._build(*key)
        return len(todo)

    def fits(self, block_lens) -> bool:
        """Whether a call with these block lengths can replay: ≤ the last batch bucket of
        requests, blocks > 1 (`DFlashDrafter` runs them all at the longest)."""
        lens = [n for n in block_lens if n]
        return bool(lens) and len(block_lens) <= BATCH_BUCKETS[-1] and min(lens) > 1

    def takes_context(self, block_lens, num_new) -> bool:
        """Whether a call that `fits` can also have the graph write its new context rows: one
        replay (a single block length), every request has a block (a slot of the static
        layout) and ≤ `context_rows` new rows."""
        return (all(block_lens) and len(set(block_lens)) == 1
                and max(num_new, default=0) <= self.context_rows)

    def run(self, step: CacheStep, bonus: list[int], n: int,
            contexts: list[torch.Tensor | None] | None = None,
            valid: list[int] | None = None) -> torch.Tensor:
        """Logits `[R, n − 1, V]` float32 of the R requests of `step` (all block length n): a
        view of the graph's static output, valid until the next replay (`DFlashDrafter.draft`
        consumes it at once; `draft_logits` copies it — the GPU test caught callers keeping
        views that the next replay overwrote). `contexts`: each request's new context rows
        `[n_i, taps · hidden]` (None: none) for the graph to write (`takes_context`); None: the
        caller wrote them. `valid`: each request's own block length ≤ n (None: all n) — the
        rows past it are padding, which no row before it sees; the caller drops their logits."""
        bb = bucket_of(len(bonus), BATCH_BUCKETS)
        st = self._graphs.get((bb, n)) or self._build(bb, n)
        st.buf.wait()
        self._fill(st, step, bonus, contexts is not None)
        self._mask(st, valid)
        st.buf.push()
        c = self.context_rows
        for i, ctx in enumerate(contexts or ()):
            if ctx is not None and ctx.shape[0]:
                st.feats[i * c : i * c + ctx.shape[0]].copy_(ctx, non_blocking=True)
        logits, packed = self._replay(st)  # [bb, n − 1, V], the graph's static output
        if packed is not None:  # [bb · (n − 1), 2K]: the call's rows to the host, in order
            self._rows = len(bonus) * (n - 1)
            self._host[: self._rows].copy_(packed[: self._rows], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        return logits[: len(bonus)]

    def host_tables(self) -> np.ndarray:
        """The last `run`'s packed top-k tables `[R · (n − 1), 2 · tables]` int32 on the host
        (request i's block rows from i · (n − 1), as its logits), once their copy has landed;
        a view, valid until the next `run`."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host[: self._rows].numpy()

    def _fill(self, st: _Static, step: CacheStep | None, bonus: list[int],
              context: bool = False) -> None:
        v = {k: h for k, (_, h) in st.views.items()}
        n, mask_id = st.n, self.model.config.mask_token_id
        self._fill_context(st, v, step if context else None)
        v["ids"][:] = mask_id
        v["ids"][::n] = 0
        v["pos"].reshape(st.bb, n)[:] = np.arange(n)
        for g in self.cache.groups.values():
            v[f"ctx_{g.name}"][:] = 0
            v[f"table_{g.name}"][:] = self.trash[g.name]
            v[f"slots_{g.name}"].reshape(st.bb, n)[:] = (self.trash[g.name] * g.page_size
                                                         + np.arange(n) % g.page_size)
        if step is None:
            return
        for i, (length, tables, slots) in enumerate(step.block_layout()):
            v["ids"][i * n] = bonus[i]
            v["pos"][i * n : (i + 1) * n] = np.arange(length, length + n)
            for name, table in tables.items():
                v[f"ctx_{name}"][i] = length
                v[f"table_{name}"][i, : len(table)] = table
                v[f"slots_{name}"][i * n : (i + 1) * n] = slots[name]

    def _mask(self, st: _Static, valid: list[int] | None) -> None:
        """The bidirectional block masks; request i's block cut to its first `valid[i]` rows
        (`block_mask`'s `valid`)."""
        for group, (window, full) in st.masks.items():
            host = st.views[f"mask_{group}"][1]  # [bb·n, W] int32
            host[:] = full
            for i, m in enumerate(valid or ()):
                if m < st.n:
                    host[i * st.n : (i + 1) * st.n] = block_mask(st.n, window, m).view(np.int32)

    def _fill_context(self, st: _Static, v: dict, step: CacheStep | None) -> None:
        """The context rows' positions and all-layer slots (`step` None: every row to trash)."""
        c = self.context_rows
        v["cpos"][:] = 0
        for g in self.cache.groups.values():
            slots = self.trash[g.name] * g.page_size + np.arange(st.bb * c) % g.page_size
            if step is not None:
                pos, slots = step.context_slots(g.name, c, slots)
                v["cpos"][: len(pos)] = pos  # the same positions in every group
            v[f"cflat_{g.name}"][:] = g.pool.all_layer_slots(slots)

    def _build(self, bb: int, n: int) -> _Static:
        st = _Static(self, bb, n)
        self._fill(st, None, [])  # all dummies: safe to run
        st.buf.push()
        if self.capture:
            self._capture(st)
        self._graphs[(bb, n)] = st
        return st

    def _outputs(self, st: _Static, batches: dict | None = None):
        """(logits `[bb, n − 1, V]` float32, their packed top-k tables `[bb · (n − 1), 2K]` int32
        or None without `tables`)."""
        logits = self._forward(st, batches)
        if self.tables is None:
            return logits, None
        return logits, pack_tables(logits.view(-1, logits.shape[-1]), self.tables)

    def _forward(self, st: _Static, batches: dict | None = None) -> torch.Tensor:
        batches = batches or st.batches
        cache = self.cache
        rows = self.model.fuse_context(st.feats)  # [bb·C, hidden], padding rows included
        for g in cache.groups.values():  # as DFlashDrafter._write_context, static rows
            k, v = self.model.context_kv_layers(g.layers, rows, st.views["cpos"][0])
            g.pool.write_all(st.views[f"cflat_{g.name}"][0], k, v)

        def layer_kv(layer):  # layer's caches, block batch and window
            group = cache.group_of[layer]
            i = group.index[layer]
            return (group.pool.k[i], group.pool.v[i], batches[(group.name, self.causal[layer])],
                    group.window)

        def attend(layer, q, k, v, scale):  # the module path's BlockAttention
            group = cache.group_of[layer]
            k_cache, v_cache, batch, window = layer_kv(layer)
            group.pool.write(group.index[layer], batch.slot_mapping, k, v)
            return cache.attn_backend(q, k_cache, v_cache, batch, scale, window)

        ids, pos = st.views["ids"][0], st.views["pos"][0]
        if self.fused:
            hidden = self.model.forward_fused(ids, pos, layer_kv, cache.attn_backend)
        else:
            hidden = self.model(ids, pos, attend)  # [bb·n, hidden]
        hidden = hidden.view(st.bb, st.n, -1)[:, 1:]  # the mask slots
        return self.model.logits(hidden.reshape(st.bb * (st.n - 1), -1)).view(
            st.bb, st.n - 1, -1)

    @torch.inference_mode()
    def _capture(self, st: _Static) -> None:
        with planned_for(self.cache, max(self.capacity.values())):
            st.graph, (st.logits, st.packed), self._pool = capture_graph(
                partial(self._outputs, st), self.device, self._pool)

    @torch.inference_mode()
    def _replay(self, st: _Static) -> tuple[torch.Tensor, torch.Tensor | None]:
        if st.graph is None:  # eager: backends that read host ctx_lens get the real ones
            batches = {}
            for (name, causal), batch in st.batches.items():
                ctx = tuple(int(c) for c in st.views[f"ctx_{name}"][1])
                batches[(name, causal)] = replace(batch, ctx_lens=ctx, memo={})
            return self._outputs(st, batches)
        st.graph.replay()
        return st.logits, st.packed


__all__ = ["DraftGraphs"]
