"""Failure isolation within one engine step: what one request breaks ends that request only.

Owns the step's batched forward: its layout (`StepBatch`: which inputs and logit rows belong to
which tree or prefill chunk) and its recovery: when the forward over several inputs raises,
each input is re-run alone, the requests whose input fails alone end with their error and one
batched forward runs over the others (a forward's KV writes are idempotent for the same inputs).
A failure that no input shows alone is step-wide and propagates. Also owns `fail`: ending one
request with an error (pages and drafter state freed as by `abort`, an ABORT output carrying
the error), which the engine uses for a request whose sampling or commit raises.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.runner import ForwardInput, ModelRunner
from specserve.engine.scheduler import Scheduled
from specserve.engine.sequence import Sequence
from specserve.engine.speculative import Planned
from specserve.types import FinishReason, RequestOutput

if TYPE_CHECKING:
    from specserve.engine.engine import Engine

log = logging.getLogger(__name__)
Pages = Callable[[str], np.ndarray]  # request id -> its page table [pages] int32


@dataclass(frozen=True, eq=False)
class StepBatch:
    """The forward of one step: trees first, then prefill chunks."""

    plans: list[Planned]
    chunks: list[Scheduled]
    logits: torch.Tensor | None  # [rows, V]: every tree row, then one per done chunk; None: empty
    feats: torch.Tensor | None  # tapped features of every flat row, when asked for
    ends: list[int]  # flat end of each input (plans, then chunks)
    done: list[int]  # indices of the chunks that end their prompt (a token is sampled there)
    # (chunk index, first logits row, rows): a prompt_logprobs chunk's rows, each predicting a
    # prompt token, after the rows above
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # each logits row's argmax on the host when a tree is greedy (one for the step); else None
    argmax: list[int] | None = None


def chunk_input(w: Scheduled, pages: Pages) -> ForwardInput:
    ids = w.seq.ids[w.start : w.start + w.num_tokens]
    return ForwardInput(w.seq.request_id, ids, range(w.start, w.start + w.num_tokens),
                        ctx_len=w.start, pages=pages(w.seq.request_id))


def run(runner: ModelRunner, pages: Pages, plans: list[Planned], chunks: list[Scheduled],
        taps: bool, meanwhile=None) -> StepBatch:
    """One batched forward over `plans` and `chunks` (none: an empty batch, no forward);
    `pages(request_id)` is a request's page table; `meanwhile()` runs while the GPU works."""
    if not plans and not chunks:
        return StepBatch([], [], None, None, [], [])
    inputs = [p.forward_input(pages(p.seq.request_id)) for p in plans]
    inputs += [chunk_input(w, pages) for w in chunks]
    ends = list(itertools.accumulate(len(x.token_ids) for x in inputs))
    rows = [r for p, e in zip(plans, ends, strict=False)
            for r in range(e - p.layout.num_rows, e)]
    done = [i for i, w in enumerate(chunks) if w.start + w.num_tokens == w.seq.num_tokens]
    rows += [ends[len(plans) + i] - 1 for i in done]
    prompt_rows = _prompt_rows(chunks, ends[len(plans):], rows)
    logits, feats = runner.forward(inputs, rows, taps=taps)
    # the greedy accept walks' argmax: one for the step, on its way to the host during the wait
    argmax = logits.argmax(dim=-1).to("cpu", non_blocking=True) \
        if any(p.seq.params.greedy for p in plans) else None  # [rows] int64
    if meanwhile is not None:
        meanwhile()
    if logits.is_cuda:  # the accept walk syncs anyway; syncing here makes verify_s true
        torch.cuda.synchronize(logits.device)
    return StepBatch(plans, chunks, logits, feats, ends, done, prompt_rows,
                     None if argmax is None else argmax.tolist())


def _prompt_rows(chunks: list[Scheduled], ends: list[int], rows: list[int]) -> list[tuple]:
    """Append to `rows` a row per prompt token still without its logprob, of the chunks that
    asked for prompt logprobs (`ends`: the chunks' flat ends); their StepBatch.prompt_rows."""
    out = []
    for i, (w, end) in enumerate(zip(chunks, ends, strict=True)):
        first = max(w.start, w.seq.prompt_logprob_count)
        last = min(w.start + w.num_tokens, len(w.seq.prompt_ids) - 1)
        if w.seq.params.prompt_logprobs is not None and last > first:
            flat = end - w.num_tokens - w.start  # the flat row of position 0
            out.append((i, len(rows), last - first))
            rows += range(flat + first, flat + last)
    return out


def forward(engine: Engine, plans: list[Planned], chunks: list[Scheduled],
            taps: bool, meanwhile=None) -> tuple[StepBatch, list[RequestOutput]]:
    """The step's forward; if it raises, again without the requests whose input fails alone.
    Returns the batch and the (error) outputs of the requests that were ended. `meanwhile()`:
    host work run once the forward is launched, before its wait."""
    pages = engine.scheduler.blocks.page_array
    try:
        return run(engine.runner, pages, plans, chunks, taps, meanwhile), []
    except Exception as error:
        bad = offenders(engine.runner, pages, plans, chunks, taps, error)
    plans = [p for p in plans if p.seq.request_id not in bad]
    chunks = [w for w in chunks if w.seq.request_id not in bad]
    failed = [fail(engine, seq, e) for seq, e in bad.values()]
    return run(engine.runner, pages, plans, chunks, taps, meanwhile), failed


def offenders(runner: ModelRunner, pages: Pages, plans: Seq[Planned], chunks: Seq[Scheduled],
              taps: bool, error: Exception) -> dict[str, tuple[Sequence, Exception]]:
    """Requests whose input alone makes the forward raise (`error` raised over all of them);
    re-raises `error` if there are none (the failure is the step's, not a request's)."""
    alone = [([p], [], p.seq) for p in plans] + [([], [w], w.seq) for w in chunks]
    if len(alone) == 1:
        return {alone[0][2].request_id: (alone[0][2], error)}
    bad = {}
    for one_plan, one_chunk, seq in alone:
        try:
            run(runner, pages, one_plan, one_chunk, taps)
        except Exception as e:
            bad[seq.request_id] = (seq, e)
    if not bad:
        raise error
    return bad


def fail(engine: Engine, seq: Sequence, error: Exception) -> RequestOutput:
    """End `seq` with `error` (pages and drafter state freed, as `abort` does); its output."""
    log.error("request %s failed; the rest of the step goes on", seq.request_id, exc_info=error)
    engine.abort(seq.request_id)
    return RequestOutput(seq.request_id, [], finish_reason=FinishReason.ABORT,
                         num_prompt_tokens=len(seq.prompt_ids),
                         num_output_tokens=len(seq.output_ids), error=error)
