"""A step's last phase: what the forward's logits become — accepted tokens, compacted KV,
outputs.

For each verified tree: the accept walk (`spec.accept`), the commit of its tokens and the KV
compaction of its accepted path (one batched slot copy for the step: `commit_trees`), then its
pages cut and the step record (`settle_trees`) — split so that the engine can ask for the next
drafts in between. For each prefill chunk: its tokens booked as computed, its tapped features
queued for the drafter, and where a prompt ends its first token sampled. A request whose
accept, sampling or commit raises ends alone (`isolation.fail`); the others go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.engine import isolation, speculative
from specserve.engine.isolation import StepBatch
from specserve.engine.speculative import Planned
from specserve.sampling import sample_rows, token_logprobs
from specserve.spec.accept import accept
from specserve.types import RequestOutput

if TYPE_CHECKING:
    from specserve.engine.engine import Engine


@dataclass(eq=False)
class Committed:
    """The trees of a step after `commit_trees`: what `settle_trees` still owes them."""

    outputs: list[RequestOutput]  # every tree's output (an error output where it failed)
    done: list[tuple]  # (plan, acceptance, output, cut, first logit row) of each committed tree
    seconds: float  # the commit's time


def commit_trees(engine: Engine, batch: StepBatch) -> Committed:
    """The accept walk, the tokens' commit and the KV compaction (one batched slot copy) of
    every tree of the step: after this, each request's next draft can be asked for (`Engine`
    may send it before `settle_trees`; the verifier's GPU work is all launched by then)."""
    t0 = time.perf_counter()
    c, row0, src, dst, keep = Committed([], [], 0.0), 0, [], [], []
    for p, end in zip(batch.plans, batch.ends, strict=False):
        n = p.layout.num_rows
        try:
            acc, out, s, d = _commit_tree(engine, p, row0, batch)
        except Exception as e:  # this request's failure ends it alone: no copies for it
            c.outputs.append(isolation.fail(engine, p.seq, e))
        else:
            if not out.finished:  # a finished request's pages are already free
                src, dst = src + s, dst + d
                keep.append((p.seq, [end - n + r for r in (0, *acc.rows)]))
            c.done.append((p, acc, out, len(out.new_token_ids) < len(acc.token_ids), row0))
            c.outputs.append(out)
        row0 += n
    engine.runner.kv.copy_slots(src, dst)  # host lists: one transfer, no sync
    _next_context(batch.feats, keep)
    c.seconds = time.perf_counter() - t0
    return c


def _next_context(feats: torch.Tensor | None, keep: list[tuple]) -> None:
    """The drafter's next context rows of the committed trees: the features of each one's root
    and accepted rows (`keep`: (sequence, flat rows) each) — one gather for the step."""
    if feats is None or not keep:
        return
    rows = torch.tensor([r for _, rs in keep for r in rs], device=feats.device)
    parts = feats.index_select(0, rows).split([len(rs) for _, rs in keep])  # [1 + accepted, F]
    for (seq, _), part in zip(keep, parts, strict=True):
        seq.pending_context.append(part)


def settle_trees(engine: Engine, batch: StepBatch, c: Committed, draft_s: float,
                 verify_s: float) -> None:
    """The rest of the trees' commit, host work only: each request's pages cut to its
    tokens, the step records."""
    if engine.adaptive is not None:
        engine.adaptive.observe_step([(p, acc.rows, row) for p, acc, *_, row in c.done],
                                     batch.logits, defer=True)  # booked in the next forward
    for p, acc, out, cut, _row in c.done:
        engine.scheduler.settle(p.seq)
        step = speculative.record(p, acc, out, cut, (draft_s, verify_s, c.seconds))
        if engine.on_step is not None:
            engine.on_step(p.seq.request_id, step)


def _commit_tree(engine: Engine, p: Planned, row0: int, batch: StepBatch):
    """One tree's accept walk and commit (its logits from `row0`): (acceptance, output, KV copy
    src and dst slots)."""
    seq, n, sched = p.seq, p.layout.num_rows, engine.scheduler
    logits = batch.logits[row0 : row0 + n]  # [n, V]
    argmax = None if batch.argmax is None else batch.argmax[row0 : row0 + n]
    acc = accept(logits, p.tree, seq.params, seq.generator, argmax)
    s, d = speculative.compaction(p, acc)
    s, d = [sched.slot(seq, x) for x in s], [sched.slot(seq, x) for x in d]
    seq.num_computed = p.start + 1 + acc.accepted_depth
    lps = None
    if seq.params.logprobs is not None:  # token k was chosen by the row of path node k - 1
        rows = torch.tensor([0, *acc.rows], device=logits.device)
        lps = token_logprobs(logits.index_select(0, rows), acc.token_ids, seq.params.logprobs)
    out = engine.commit_tokens(seq, acc.token_ids)  # before it: nothing left that can fail
    if lps is not None:
        out.logprobs = lps[: len(out.new_token_ids)]
    return acc, out, s, d


def end_chunks(engine: Engine, batch: StepBatch, verify_s: float) -> list[RequestOutput]:
    """Book the step's prefill chunks; sample the first token where a prompt is done."""
    for w, e in zip(batch.chunks, batch.ends[len(batch.plans):], strict=True):
        w.seq.num_computed += w.num_tokens
        w.seq.spec_stats.prefill_s += verify_s  # the forward this chunk rode in
        if batch.feats is not None:
            w.seq.pending_context.append(batch.feats[e - w.num_tokens : e])
    speculative.feed(engine.drafter, [w.seq for w in batch.chunks])  # before any release
    failed = _prompt_logprobs(engine, batch)
    offset, outputs = sum(p.layout.num_rows for p in batch.plans), list(failed.values())
    for j, i in enumerate(batch.done):
        seq, rows = batch.chunks[i].seq, batch.logits[offset + j : offset + j + 1]
        if seq.request_id in failed:
            continue
        try:
            token = sample_rows(rows, seq.params, seq.generator)
            lps = None if seq.params.logprobs is None else \
                token_logprobs(rows, token, seq.params.logprobs)
            prompt = None if seq.output_ids or seq.params.prompt_logprobs is None else \
                seq.prompt_logprobs
            outputs.append(out := engine.commit_tokens(seq, token))
            out.logprobs, out.prompt_logprobs = lps, prompt
            seq.prompt_logprobs = []  # sent with the first token
        except Exception as e:  # this request's failure ends it alone
            outputs.append(isolation.fail(engine, seq, e))
    return outputs


def _prompt_logprobs(engine: Engine, batch: StepBatch) -> dict[str, RequestOutput]:
    """The prompt tokens' logprobs of the step's prompt_logprobs chunks (row p: token p + 1);
    a request whose fail ends alone: its output, by request id."""
    failed = {}
    for i, row, n in batch.prompt_rows:
        seq = batch.chunks[i].seq
        try:
            known = seq.prompt_logprob_count + 1
            seq.prompt_logprobs += token_logprobs(batch.logits[row : row + n],
                                                  seq.prompt_ids[known : known + n],
                                                  seq.params.prompt_logprobs)
            seq.prompt_logprob_count += n
        except Exception as e:  # this request's failure ends it alone
            failed[seq.request_id] = isolation.fail(engine, seq, e)
    return failed
