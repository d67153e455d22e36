"""The DFlash drafter: one batched block forward per step, then a DDTree (or a chain) per request.

Owns the per-step flow behind the `Drafter` protocol: check that each request's new context
features continue what its context cache holds, append them (context K/V of every layer), run
every request's block `[bonus, mask × (n−1)]` in one forward over the paged context
(drafters/dflash_cache.py), and turn each request's `[n−1, V]` draft logits into a tree. The
block length is `1 + min(block_size − 1, max_depth)`, so near max_tokens it shrinks exactly like
the reference's `verify_size`. Model math: models/dflash.py; tree building: spec/ddtree.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specserve.drafters.base import Drafter, DraftRequest
from specserve.drafters.dflash_cache import DFlashContextCache
from specserve.drafters.dflash_graphs import DraftGraphs
from specserve.drafters.dflash_step import CacheStep, StepItem
from specserve.kernels.topk import graph_k
from specserve.models.dflash import DFlashDraftModel
from specserve.spec.ddtree import build_ddtree, topk_logprobs, unpack_tables
from specserve.spec.tree import DraftTree, chain_tree, check_budget


@dataclass(frozen=True)
class DraftStats:
    """Timings and sizes of the last draft call."""

    num_requests: int
    context_rows: int  # new context rows appended
    block_rows: int  # block query rows run
    forward_s: float  # context K/V + block forward + logits
    tree_s: float  # top-k + tree build


class DFlashDrafter(Drafter):
    """`Drafter` over a `DFlashDraftModel`; `tree=False` proposes the argmax chain instead."""

    def __init__(self, model: DFlashDraftModel, num_pages: int, page_size: int = 16, *,
                 sliding_num_pages: int | None = None, tree: bool = True,
                 poison: bool = False, graphs: bool | None = None,
                 capture: bool | None = None, fused_layers: bool = True,
                 graph_tables: bool = True) -> None:
        weight = model.fc.weight
        self.model, self.tree = model.eval(), tree
        self.cache = DFlashContextCache(model.config, num_pages, page_size,
                                        sliding_num_pages=sliding_num_pages, dtype=weight.dtype,
                                        device=weight.device, poison=poison)
        # graphs: block forwards through static buffers (drafters/dflash_graphs.py), captured
        # as CUDA graphs on CUDA (capture None); None = on for CUDA: a DDTree step about twice
        # as fast (bench/diag_draft.py --graphs; BENCHMARKS.md, "Prefill attention through
        # cuDNN, DFlash drafter CUDA graphs")
        if graphs is None:
            graphs = weight.device.type == "cuda"
        # fused_layers: the graphs' block forward through the target's fused layer kernels
        # (DraftGraphs `fused`): a faster graph forward and decode step (BENCHMARKS.md, "DFlash
        # decode: the steps before max_tokens, and the fused-layer drafter", and "Figures
        # formerly in source comments")
        # graph_tables: the graphs also compute the top-k tables the trees are built from (a
        # chain drafter's: the top-1), one host copy a replay (DraftGraphs `tables`)
        tables = (graph_k(model.config.vocab_size) if tree else 1) if graph_tables else None
        self.graphs = DraftGraphs(self.model, self.cache, capture, fused_layers, tables) \
            if graphs else None
        self._slots: dict[int, int] | None = None  # request → its block in the graphs' tables
        self._stride = 0  # table rows per block there
        self.last_stats: DraftStats | None = None

    needs_context = True  # drafts from the target's tap-layer features

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs are this drafter's context features."""
        return tuple(self.model.config.target_layer_ids)

    def block_len(self, request: DraftRequest) -> int:
        """Block tokens run for `request`: the bonus plus up to block_size − 1 masks (0: none)."""
        depth = min(self.model.config.block_size - 1, request.max_depth)
        return 1 + depth if depth > 0 else 0

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request; budget 0 or max_depth 0: an empty tree (context still kept)."""
        for r in requests:
            check_budget(r.budget)
        t0 = self._now()
        logits = self._run(requests, [self.block_len(r) if r.budget else 0 for r in requests])
        t1 = self._now()
        trees = self._trees(requests, logits)
        self.last_stats = DraftStats(
            num_requests=len(requests),
            context_rows=sum(self._num_new(r) for r in requests),
            block_rows=sum(lg.shape[0] + 1 for lg in logits if lg.shape[0]),
            forward_s=t1 - t0, tree_s=self._now() - t1)
        return trees

    def feed(self, requests: Sequence[DraftRequest]) -> bool:
        """Take context rows ahead of the first draft (prefill chunks): budget-0 drafts."""
        self.draft([replace(r, budget=0) for r in requests])
        return True

    def draft_logits(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor]:
        """Raw draft logits `[n − 1, V]` float32 per request (block slots 1..n−1; any budget);
        the caller's to keep (copies of a CUDA graph's static output, which the next call's
        replay overwrites)."""
        logits = self._run(requests, [self.block_len(r) for r in requests])
        return [lg.clone() for lg in logits] if self.graphs is not None else logits

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def _now(self) -> float:
        if self.model.fc.weight.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @staticmethod
    def _num_new(request: DraftRequest) -> int:
        return 0 if request.context is None else int(request.context.shape[0])

    def problem(self, request: DraftRequest) -> str | None:
        """Why `request` cannot be drafted here (None: it can). `draft` raises ValueError with
        it; the drafter service checks each entry up front so only that entry fails."""
        cfg, rid = self.model.config, request.request_id
        if request.max_depth < 0:
            return f"request {rid!r}: max_depth must be non-negative, got {request.max_depth}"
        if not 0 <= request.bonus_token < cfg.vocab_size:
            return (f"request {rid!r}: bonus token {request.bonus_token} outside the "
                    f"vocabulary ({cfg.vocab_size})")
        width = cfg.hidden_size if request.context_fused else cfg.num_taps * cfg.hidden_size
        ctx = request.context
        if ctx is not None and (ctx.ndim != 2 or ctx.shape[1] != width):
            return f"request {rid!r}: context must be [n_new, {width}], got {tuple(ctx.shape)}"
        held, new = self.cache.length(rid), self._num_new(request)
        if request.start - new != held:
            return (f"request {rid!r}: context covers positions [{request.start - new}, "
                    f"{request.start}) but the drafter holds [0, {held}); it must continue at "
                    f"{held}")
        return None

    @torch.inference_mode()
    def _run(
        self, requests: Sequence[DraftRequest], block_lens: Sequence[int]
    ) -> list[torch.Tensor]:  # [n - 1, V] float32 per request
        for r in requests:
            if (why := self.problem(r)) is not None:
                raise ValueError(why)
        num_new = [self._num_new(r) for r in requests]
        self._slots = None  # set by a replay that computed tables
        graphed = self.graphs is not None and self.graphs.fits(block_lens)
        # the graphs run every block at the call's longest, a shorter one masked to its length
        run_lens = ([max(block_lens) if n else 0 for n in block_lens] if graphed
                    else list(block_lens))
        step = self.cache.begin([StepItem(r.request_id, c, n)
                                 for r, c, n in zip(requests, num_new, run_lens, strict=True)])
        in_graph = (graphed and self.graphs.takes_context(run_lens, num_new)
                    and not any(r.context_fused for r in requests))
        if not in_graph:  # the graph writes a decode step's few raw rows itself
            self._write_context(step, [r for r, c in zip(requests, num_new, strict=True) if c])
        vocab, device = self.model.config.vocab_size, self.cache.device
        empty = torch.empty(0, vocab, dtype=torch.float32, device=device)
        if not any(block_lens):
            return [empty for _ in requests]
        if graphed:
            contexts = [r.context if c else None for r, c in zip(requests, num_new, strict=True)
                        ] if in_graph else None
            return self._replay(step, requests, block_lens, contexts, empty)
        mask = self.model.config.mask_token_id
        ids = torch.tensor([t for r, n in zip(requests, block_lens, strict=True) if n
                            for t in [r.bonus_token] + [mask] * (n - 1)], device=device)
        hidden = self.model(ids, step.block_positions(), step.attend)  # [T, hidden]
        out, row = [], 0
        for n in block_lens:
            out.append(self.model.logits(hidden[row + 1 : row + n]) if n else empty)  # [n-1, V]
            row += n
        return out

    def _replay(self, step: CacheStep, requests, block_lens, contexts, empty):
        """The call's blocks through one graph replay at the longest block: a request near
        max_tokens (a shorter block than the rest of its batch) runs padded, its block masked
        to its own length, and keeps its first n − 1 rows (before, each length had its own
        replay, after an eager context write: BENCHMARKS.md, "The DFlash drafter at batch 8:
        one replay a call, one top-k a call")."""
        idx = [i for i, n in enumerate(block_lens) if n]
        sub = step if len(idx) == len(requests) else step.subset(idx)
        valid = [block_lens[i] for i in idx]
        got = self.graphs.run(sub, [requests[i].bonus_token for i in idx], max(valid), contexts,
                              valid=valid)
        if self.graphs.tables is not None:
            self._slots, self._stride = {i: j for j, i in enumerate(idx)}, max(valid) - 1
        out = [empty] * len(requests)
        for i, n, lg in zip(idx, valid, got, strict=True):
            out[i] = lg[: n - 1]
        return out

    def _write_context(self, step: CacheStep, requests: list[DraftRequest]) -> None:
        """Context K/V of every layer for the new rows of `requests` (one fc for all raw rows;
        rows sent fused skip it; per layer group one stacked k|v GEMM and one scatter: the eager
        context write was most of a draft step's kernel launches with its block forward graphed;
        BENCHMARKS.md, "DFlash context write batched per layer group")."""
        if not requests:
            return
        weight = self.model.fc.weight
        rows = [r.context.to(device=weight.device, dtype=weight.dtype) for r in requests]
        raw = [x for x, r in zip(rows, requests, strict=True) if not r.context_fused]
        fused_raw = self.model.fuse_context(torch.cat(raw)) if raw else None  # [N_raw, hidden]
        if len(raw) == len(rows):
            fused = fused_raw  # one fc over all rows, as before
        else:
            parts = iter(fused_raw.split([x.shape[0] for x in raw]) if raw else ())
            fused = torch.cat([x if r.context_fused else next(parts)
                               for x, r in zip(rows, requests, strict=True)])
        for name in self.cache.groups:  # per layer group: one GEMM, one scatter
            step.write_group_context(name, fused, self.model)

    def _trees(self, requests: Sequence[DraftRequest], logits: list[torch.Tensor]
               ) -> list[DraftTree]:
        """Each request's tree from its `[n_i − 1, V]` logits: the top-k tables the graph
        replay computed and copied (else one top-k — a chain drafter: one argmax — over the rows
        of every request and one host copy for the call), then a heap per request (a top-k and
        a copy per request made the tree build most of a batch-8 draft step: BENCHMARKS.md, "The
        DFlash drafter at batch 8: one replay a call, one top-k a call"). A budget below the
        call's largest keeps the first columns of its rows (the top-k is sorted). Requests
        asking for a chain take their top-1 rows, no heap."""
        trees = [DraftTree.empty()] * len(requests)
        live = [i for i, r in enumerate(requests) if r.budget and logits[i].shape[0]]
        if not live:
            return trees
        if not self.tree:
            for i, path in self._paths(logits, live):  # [L_i] each
                trees[i] = chain_tree(path[: requests[i].budget])
            return trees
        chains = [i for i in live if requests[i].chain]
        for i, lp, ids in self._tables(logits, chains, 1):  # [L_i, 1] each
            n = min(requests[i].budget, lp.shape[0])
            trees[i] = chain_tree(ids[:n, 0], np.minimum(np.cumsum(lp[:n, 0]), 0.0))
        rest = [i for i in live if not requests[i].chain]
        k = min(max((requests[i].budget for i in rest), default=1), logits[live[0]].shape[1])
        for i, lp, ids in self._tables(logits, rest, k):  # [L_i, K] each
            k_i = min(requests[i].budget, k)
            trees[i] = build_ddtree(lp[:, :k_i], ids[:, :k_i], requests[i].budget, lp.shape[0])
        return trees

    def _graphed(self, k: int) -> bool:
        """Whether the last replay's tables hold the top `k` of this call's rows."""
        return self._slots is not None and k <= self.graphs.tables

    def _paths(self, logits: list[torch.Tensor], idx: list[int]):
        """(i, argmax path [L_i]) for each request i of `idx`: the graph's top-1, else one
        argmax and one host copy for all of them."""
        if self._graphed(1):
            return [(i, ids[:, 0]) for i, _, ids in self._tables(logits, idx, 1)]
        paths = _rows(logits, idx).argmax(dim=-1).cpu().numpy()
        return zip(idx, np.split(paths, _ends(logits, idx)), strict=True)

    def _tables(self, logits: list[torch.Tensor], idx: list[int], k: int):
        """(i, log-probs [L_i, k], ids [L_i, k]) for each request i of `idx`: the graph's
        tables where they are wide enough, else one top-k and one host copy for all of them."""
        if not idx:
            return []
        if not self._graphed(k):
            return _topk_tables(logits, idx, k)
        host = self.graphs.host_tables()  # [R · stride, 2K] int32
        out = []
        for i in idx:
            at = self._slots[i] * self._stride
            lp, ids = unpack_tables(host[at : at + logits[i].shape[0]], self.graphs.tables, k)
            out.append((i, lp, ids))
        return out


def _rows(logits: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
    """The logits of the requests of `idx` laid end to end `[ΣL, V]` (one: no copy)."""
    return logits[idx[0]] if len(idx) == 1 else torch.cat([logits[i] for i in idx])


def _ends(logits: list[torch.Tensor], idx: list[int]) -> np.ndarray:
    """Where each next request's rows start in the rows of `idx` laid end to end."""
    return np.cumsum([logits[i].shape[0] for i in idx])[:-1]


def _topk_tables(logits: list[torch.Tensor], idx: list[int], k: int):
    """(i, log-probs [L_i, k], ids [L_i, k]) for each request i of `idx`: one top-k and one
    host copy for all of them."""
    if not idx:
        return []
    logprobs, token_ids = topk_logprobs(_rows(logits, idx), k)  # [ΣL, k] each, on the host
    ends = _ends(logits, idx)
    return zip(idx, np.split(logprobs, ends), np.split(token_ids, ends), strict=True)
