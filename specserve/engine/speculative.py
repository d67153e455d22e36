"""One speculative round for the decoding requests of a step: draft → (verify) → commit.

The engine owns the batch forward (verify happens in the same forward as the prefill chunks);
this module owns what surrounds it: asking the drafter for one tree per request (one batched
call; a failing or misbehaving drafter degrades to root-only trees, never to an error), laying
the trees out for verification, and committing the accepted path — KV compaction from the
scratch rows into the request's next slots, the drafter's next context features, metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.drafters.base import Drafter, DraftRequest
from specserve.engine.runner import ForwardInput
from specserve.engine.sequence import Sequence
from specserve.spec.accept import Acceptance
from specserve.spec.metrics import StepOutcome, StepRecord
from specserve.spec.shapes import Choice
from specserve.spec.tree import DraftTree, VerifyLayout, verify_layout
from specserve.types import RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Planned:
    """A decoding request's tree for this step."""

    seq: Sequence
    tree: DraftTree
    layout: VerifyLayout
    budget: int  # nodes the drafter was asked for (adaptive: at most the request's budget)
    fallback: str | None = None
    drafted: bool = True  # False: adaptive speculation skipped the drafter for it this step
    choice: Choice | None = None  # adaptive speculation's shape (None: the budget as asked)
    first: bool = False  # the request's first draft: the drafter took in its prompt's context
    chain: bool = False  # the drafter was asked for its argmax chain (`Ask`), not a tree

    @property
    def start(self) -> int:
        return self.seq.num_computed

    def forward_input(self, pages) -> ForwardInput:  # pages: the request's page table
        return ForwardInput(self.seq.request_id, self.layout.token_ids, self.layout.positions,
                            ctx_len=self.start, tree_mask=self.layout.mask, pages=pages)


class Ask(NamedTuple):
    """What adaptive speculation asks the drafter for, for one request."""

    budget: int  # draft nodes (at most the request's budget)
    chain: bool = False  # the drafter's argmax chain of `budget` nodes, not its tree


def draft_requests(seqs: Seq[Sequence], max_len: int,
                   budgets: dict[str, Ask] | None = None) -> list[DraftRequest]:
    """The drafter's requests for `seqs`: each its own budget, or `budgets`' (adaptive)."""
    out = []
    for seq in seqs:
        start = seq.num_computed
        room = min(seq.params.max_tokens - len(seq.output_ids), max_len - 1 - start)
        ctx = torch.cat(seq.pending_context) if seq.pending_context else None
        budget, chain = (budgets or {}).get(seq.request_id, (seq.budget, False))
        out.append(DraftRequest(seq.request_id, seq.last_token, start, budget,
                                max(room, 0), ctx, seq.ids, kind=seq.drafter_kind,
                                chain=chain))
    return out


def feed(drafter: Drafter | None, seqs: Seq[Sequence]) -> None:
    """Hand the context features of this step's prefill chunks to a drafter that takes them
    early (its optional `feed`: budget-0 requests, no tree wanted), so the drafter builds its
    context while the target prefills and the first draft does not carry the whole prompt's
    features (prefill sends them in chunks). If the drafter does not take them, or raises,
    they stay pending and go with the first draft."""
    seqs = [s for s in seqs if s.budget > 0 and s.pending_context]
    if drafter is None or not seqs:
        return
    reqs = [DraftRequest(s.request_id, s.ids[s.num_computed - 1], s.num_computed, 0, 0,
                         torch.cat(s.pending_context), kind=s.drafter_kind)
            for s in seqs]  # no history: no root yet
    try:
        if not drafter.feed(reqs):
            return
    except Exception:  # the first draft sends them instead
        log.exception("feeding context to the drafter failed for %s", [r.request_id for r in reqs])
        return
    for s in seqs:
        s.pending_context.clear()


def _check_tree(tree: DraftTree, req: DraftRequest, vocab: int) -> str | None:
    if tree.n > req.budget:
        return "invalid_tree: over budget"
    if tree.n and tree.max_depth > req.max_depth:
        return "invalid_tree: too deep"
    if tree.n and not (int(tree.token_ids.min()) >= 0 and int(tree.token_ids.max()) < vocab):
        return "invalid_tree: token out of vocabulary"
    return None


def plan(
    seqs: Seq[Sequence], drafter: Drafter | None, max_len: int, vocab: int,
    budgets: dict[str, Ask] | None = None,
) -> tuple[list[Planned], float]:
    """Draft one tree per decoding request; returns the plans and the drafting time (s)."""
    t0 = time.perf_counter()
    reqs = draft_requests(seqs, max_len, budgets)
    wanted = [r for r in reqs if r.budget > 0]
    got = None
    if drafter is not None and wanted:
        try:
            got = drafter.draft(wanted)
        except Exception as e:  # a drafter failure costs speed, never correctness
            got = e
    return planned(seqs, reqs, wanted, got, drafter, vocab), time.perf_counter() - t0


def planned(seqs: Seq[Sequence], reqs: Seq[DraftRequest], wanted: Seq[DraftRequest],
            got: list[DraftTree] | Exception | None, drafter: Drafter | None,
            vocab: int) -> list[Planned]:
    """The plans of `seqs` (drafted as `reqs`) from `drafter`'s answer for `wanted`: its
    trees, the exception it raised, or None (it was not asked). A bad tree or a failure
    degrades that request to a root-only tree with the reason recorded; so does an empty tree
    the drafter reports an entry error for (`take_entry_errors`, read with its answer)."""
    has_drafter = drafter is not None
    trees: dict[str, DraftTree] = {}
    fallback: dict[str, str] = {}
    entry = drafter.take_entry_errors() if has_drafter and isinstance(got, list) else {}
    try:
        if isinstance(got, Exception):
            raise got
        if got is not None and len(got) != len(wanted):
            raise ValueError(f"drafter returned {len(got)} trees for {len(wanted)} requests")
        for req, tree in zip(wanted, got or (), strict=False):
            reason = _check_tree(tree, req, vocab)
            trees[req.request_id] = DraftTree.empty() if reason else tree
            if reason:
                fallback[req.request_id] = reason
    except Exception as e:  # noqa: BLE001 — speed lost, never correctness
        fallback = {r.request_id: f"drafter_error: {type(e).__name__}: {e}" for r in wanted}
    for seq in seqs:  # the context went to the drafter (or is moot without one)
        if has_drafter and seq.request_id not in fallback:
            seq.pending_context.clear()
    out = []
    for seq, req in zip(seqs, reqs, strict=True):
        tree = trees.get(seq.request_id, DraftTree.empty())
        why = fallback.get(seq.request_id) or (entry.get(seq.request_id) if not tree.n else None)
        out.append(Planned(seq, tree, verify_layout(tree, req.bonus_token, req.start),
                           req.budget, why, first=bool(tree.n) and not seq.drafts,
                           chain=req.chain))
        seq.drafts += bool(tree.n)
    return out


def compaction(p: Planned, acc: Acceptance) -> tuple[list[int], list[int]]:
    """Positions to copy so the accepted path sits right after the root: (src, dst)."""
    src = [p.start + row for d, row in enumerate(acc.rows, 1) if row != d]
    dst = [p.start + d for d, row in enumerate(acc.rows, 1) if row != d]
    return src, dst


def record(p: Planned, acc: Acceptance, out: RequestOutput, cut: bool,
           times: tuple[float, float, float]) -> StepRecord:
    """The step's record for `p`: added to the request's stats (with the step's draft, verify
    and commit seconds) and put in `out.stats`."""
    c = p.choice
    step = StepRecord(p.seq.budget, p.tree.n, acc.accepted_depth, len(out.new_token_ids), cut,
                      p.fallback, None if c is None else c.shape, None if c is None else c.why)
    stats = p.seq.spec_stats
    stats.record(step)
    stats.draft_s, stats.verify_s, stats.commit_s = (
        a + b for a, b in zip((stats.draft_s, stats.verify_s, stats.commit_s), times,
                              strict=True))
    out.stats = StepOutcome(step, stats, int(p.layout.positions[0]))
    return step
