"""The in-process engine API: `add_request` / `abort` / `step` → per-request outputs.

Owns the request table, the step's four phases (schedule → draft plan → run → postprocess) and
committing tokens (stop tokens, stop strings, max_tokens, incremental text). Scheduling and the
KV pages are `engine.scheduler`'s, the forward is `engine.runner`'s, the accept walk and commit
of a step's trees `engine.postprocess`'s; `engine.isolation` makes a request whose forward
input, sampling or commit raises end alone (`RequestOutput.error`). Synchronous and
single-threaded: services drive it from their own loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

from specserve.config import EngineConfig
from specserve.drafters.base import Drafter
from specserve.engine import isolation, overlap, postprocess, speculative
from specserve.engine.adaptive import Adaptive
from specserve.engine.cost import CostModel, StepCycle, observe_step
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import Scheduled, Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.errors import InvalidRequest, check_context, check_request_id, integer_ids
from specserve.models.decoder import DecoderModel
from specserve.sampling import make_generator
from specserve.spec.metrics import RequestSpecStats, StepTimes
from specserve.types import FinishReason, RequestOutput, SamplingParams


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: DecoderModel | None = None,
        tokenizer=None,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.on_step = None  # optional callback(request_id, StepRecord) — tests check invariants
        self.last_step: StepTimes | None = None  # wall-clock marks of the latest step (traces)
        self.runner = ModelRunner(config, model)
        self.cost = CostModel()  # with adaptive: measured on every decode step (warm-up's first)
        self._cycle = StepCycle()  # the rest of each step's cycle, for the cost model
        self.adaptive = Adaptive(self.cost, self._pad_rows) if config.adaptive else None
        self.set_drafter(drafter)
        self.model_config = self.runner.model.config
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = tokenizer if tokenizer is not None else _maybe_tokenizer(config)
        self.scheduler = Scheduler.of(config, self.runner.num_pages, self.model_config)
        self.requests: dict[str, Sequence] = {}
        self._draft_rows = 0  # context rows the step's drafts carried (adaptive cost model)
        self._arrivals = itertools.count()

    def set_drafter(self, drafter: Drafter | None) -> None:
        """Use `drafter` from the next step on. A drafter that wants context features names the
        target layers to tap (`target_layer_ids`); the runner then returns their outputs."""
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"a drafter subclasses specserve.drafters.base.Drafter, got "
                            f"{type(drafter).__name__}")
        self.drafter = drafter
        self._alternation = overlap.Alternation()  # a new drafter: nothing in flight
        early = self.config.draft_ahead and not self.config.overlap
        self._ahead = overlap.Ahead() if early and drafter and drafter.asynchronous else None
        self._needs_context = drafter is not None and drafter.needs_context
        taps = tuple(drafter.target_layer_ids) if self._needs_context else ()
        self.runner.set_taps(taps or self.config.tap_layers)

    @property
    def blocks(self):  # the scheduler's BlockManager (read-only use: stats, warm-up, tests)
        return self.scheduler.blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None, budget: int = 0,
                    drafter_kind: str | None = None) -> None:
        """Validate and queue a request; `budget` draft nodes per step (0 = no speculation),
        by the drafter named `drafter_kind` where the drafter serves several (None: its default).
        A text prompt gets the tokenizer's special tokens (a BOS), as transformers'
        `tokenizer(text)`; its outputs' text leaves special tokens (EOS) out, as the gateway's.

        Raises InvalidRequest / CapacityExhausted; on error nothing is queued and other requests
        are unaffected."""
        params = params or SamplingParams()
        if check_request_id(request_id) in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if type(budget) is not int or not 0 <= budget <= self.config.max_draft_tokens:
            raise InvalidRequest(f"budget must be in [0, {self.config.max_draft_tokens}] "
                                 f"(the engine's max_draft_tokens), got {budget}")
        prompt_ids = self._prompt_ids(prompt, params.max_tokens)
        seq = Sequence(request_id=request_id, prompt_ids=prompt_ids, params=params,
                       stop_ids=self._stop_ids(params), max_len=self.max_model_len,
                       generator=make_generator(params, self.runner.device),
                       arrival=next(self._arrivals), budget=budget, drafter_kind=drafter_kind,
                       spec_stats=RequestSpecStats(device=self.runner.device_name))
        if self.tokenizer is not None:
            from specserve.tokenizer import IncrementalDetokenizer, StopStringMatcher

            seq.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                               skip_special_tokens=True)
            seq.stopper = StopStringMatcher(params.stop, params.include_stop_str_in_output) \
                if params.stop else None
        elif params.stop:
            raise InvalidRequest("stop strings need a tokenizer; this engine has none")
        self.scheduler.add(seq)
        self.requests[request_id] = seq

    def _prompt_ids(self, prompt: str | Seq[int], max_tokens: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a tokenizer; send token ids instead")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:  # on the engine thread, between steps: C loops for the usual plain ints
            ids = integer_ids(prompt)  # numpy / torch integers too, never floats or bools
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise InvalidRequest(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:8]}")
        check_context(len(ids), max_tokens, self.max_model_len)
        return ids

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        if bad := [t for t in params.stop_token_ids if t >= self.model_config.vocab_size]:
            raise InvalidRequest(f"stop_token_ids out of vocabulary [0, "
                                 f"{self.model_config.vocab_size}): {bad[:8]}", "stop_token_ids")
        eos = () if params.ignore_eos else self._eos_ids()
        return frozenset(params.stop_token_ids) | frozenset(eos)

    def _eos_ids(self) -> tuple[int, ...]:
        tok_eos = getattr(self.tokenizer, "eos_token_ids", ()) if self.tokenizer else ()
        return tuple(self.model_config.eos_token_ids) + tuple(tok_eos)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its pages at once; False if it is unknown or finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.finish(seq)
        self._release(request_id)
        return True

    def _release(self, request_id: str) -> None:
        if self.adaptive is not None:
            self.adaptive.release(request_id)
        if self.drafter is not None:
            self.drafter.release(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round in four phases: schedule (who runs, with how many tokens) → draft plan
        (each decoding request's tree) → run (one forward over every tree and prefill chunk:
        the verify) → postprocess (accept, commit, sample). Returns outputs of requests that
        produced tokens, and of requests that failed (`error` set: they end, the others go on)."""
        t_start, self.last_step = time.time_ns(), None
        work = self._schedule()
        if not work:
            return []
        plans, chunks, draft_s, span = self._draft_plan(work)
        t_draft = time.time_ns()
        batch, outputs, verify_s = self._run(plans, chunks)
        t_verify = time.time_ns()
        committed = postprocess.commit_trees(self, batch)
        outputs += committed.outputs
        outputs += postprocess.end_chunks(self, batch, verify_s)
        if self._ahead is not None:  # the next drafts, while the rest of the commit runs
            self._ahead.send(self.scheduler.running, self.drafter, self.max_model_len,
                             self.adaptive)
        postprocess.settle_trees(self, batch, committed, draft_s, verify_s)
        self.last_step = StepTimes(t_start, t_draft, t_verify, time.time_ns(), tuple(
            (w.seq.request_id, w.start, w.num_tokens) for w in batch.chunks))
        self._observe_cost(batch, draft_s, span)
        for out in outputs:
            if out.stats is not None:
                out.stats.times = self.last_step
        return outputs

    def _schedule(self) -> list[Scheduled]:
        work = self.scheduler.schedule()
        for seq in self.scheduler.take_preempted():  # recomputed from 0: so is its draft state
            self._release(seq.request_id)
            seq.drafts = 0
        return work

    def _draft_plan(self, work: list[Scheduled]):
        """(trees, prefill chunks, draft seconds, the step's rows span) — each tree's rows
        within its request's pages (under CUDA graphs every tree of the step is padded to the
        step's rows bucket, `span`; 0 without)."""
        decoding = [w.seq for w in work if not w.seq.in_prefill]
        chunks = [w for w in work if w.seq.in_prefill]
        plans, draft_s = self._plan(decoding)
        span = self.runner.step_rows([p.layout.num_rows for p in plans])
        for p in plans:
            self.scheduler.make_room(p.seq, p.start + max(p.layout.num_rows, span))
        return plans, chunks, draft_s, span

    def _run(self, plans, chunks) -> tuple[isolation.StepBatch, list[RequestOutput], float]:
        """The forward (with failure isolation): the batch, failed requests' outputs, seconds."""
        t0 = time.perf_counter()
        batch, failed = isolation.forward(self, plans, chunks, self._needs_context,
                                          self.adaptive and self.adaptive.book_pending)
        return batch, failed, time.perf_counter() - t0

    def _plan(self, decoding: list[Sequence]) -> tuple[list[speculative.Planned], float]:
        """The step's trees: drafted now, sent for during the last step's commit
        (`draft_ahead`), or with `overlap` one group's, drafted last step; with adaptive
        speculation, cut to (or skipped for) the step's choice."""
        args = (self.drafter, self.max_model_len, self.model_config.vocab_size)
        if self.adaptive is not None and self.drafter is not None:
            _, skip = self.adaptive.to_draft([s for s in decoding if s.budget])
            sent = set() if self._ahead is None else self._ahead.sent()
            skip = [s for s in skip if s.request_id not in sent]  # asked for: it is verified
            out = {s.request_id for s in skip}
            now = [s for s in decoding if s.request_id not in out]
            self._draft_rows = sum(x.shape[0] for s in now for x in s.pending_context)
            budgets = self.adaptive.draft_budgets(now)
            plans, draft_s = speculative.plan(now, *args, budgets) if self._ahead is None \
                else self._ahead.plan(now, *args, budgets)
            plans += [self.adaptive.skipped(s) for s in skip]
        elif self._ahead is not None:
            return self._ahead.plan(decoding, *args)
        elif self.config.overlap and self.drafter is not None and self.drafter.asynchronous:
            plans, draft_s = self._alternation.plan(decoding, *args)[:2]
        else:
            return speculative.plan(decoding, *args)
        if self.adaptive is not None:
            self.adaptive.shape(plans)
        return plans, draft_s

    def _pad_rows(self, rows: int) -> int:
        return self.runner.step_rows([rows]) or rows

    def _observe_cost(self, batch, draft_s: float, span: int) -> None:
        """Book a decode-only step's times in the cost model (a prefill chunk's would not say
        what a tree costs) — in the next forward's wait, with the policy's bookings."""
        if self.adaptive is None or self.last_step is None:
            return
        t, draft_s = self.last_step, None if self.config.overlap else draft_s
        rest = self._cycle.rest(t, batch, draft_s)
        if not batch.chunks and batch.plans:
            observe_step(self.cost, batch.plans, span, (t.end_ns - t.draft_end_ns) / 1e9,
                         draft_s, self._draft_rows, getattr(self.runner.graphs, "builds", 0),
                         overhead_s=rest, defer=True)

    def commit_tokens(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append generated tokens (stopping at the first that ends the request: a stop id, the
        length, or the token whose text completes a stop string); its output."""
        per_token = seq.stopper is not None  # a stop string is looked for after each token
        reason, taken, text = None, [], ""
        for t in tokens:
            taken.append(t)
            reason = seq.append(t)
            if per_token:
                delta, reason = seq.text_delta([t], reason)
                text += delta
            if reason is not None:
                break
        if not per_token:
            text, reason = seq.text_delta(taken, reason)
        out = RequestOutput(
            seq.request_id, taken, text, reason, len(seq.prompt_ids), len(seq.output_ids)
        )
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            self._release(seq.request_id)
        return out

    # ---- convenience -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | Seq[int]],
        params: SamplingParams | None = None,
        budget: int = 0,
    ) -> list[list[int]]:
        """Run prompts to completion; returns each request's generated token ids."""
        ids = []
        for i, p in enumerate(prompts):
            rid = f"gen-{next(self._arrivals)}-{i}"
            self.add_request(rid, p, params, budget)
            ids.append(rid)
        got: dict[str, list[int]] = {r: [] for r in ids}
        while self.has_unfinished:
            for out in self.step():
                got[out.request_id].extend(out.new_token_ids)
        return [got[r] for r in ids]


def _maybe_tokenizer(config: EngineConfig):
    if not (Path(config.model_dir) / "tokenizer.json").exists():
        return None
    from specserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(config.model_dir)


__all__ = ["Engine", "Status"]
