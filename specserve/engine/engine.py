"""The in-process engine API: `add_request` / `abort` / `step` → per-request outputs.

Owns the request table and output processing (sampling the next token, stop tokens, stop
strings, max_tokens, incremental text). Scheduling is `engine.scheduler`'s, the forward is
`engine.runner`'s. Synchronous and single-threaded: services drive it from their own loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

from specserve.config import EngineConfig
from specserve.engine.runner import ForwardInput, ModelRunner
from specserve.engine.sampling import make_generator, sample_rows
from specserve.engine.scheduler import Scheduled, Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.errors import InvalidRequest
from specserve.models.decoder import DecoderModel
from specserve.types import FinishReason, RequestOutput, SamplingParams


class Engine:
    def __init__(
        self, config: EngineConfig, model: DecoderModel | None = None, tokenizer=None
    ) -> None:
        self.config = config
        self.runner = ModelRunner(config, model)
        self.model_config = self.runner.model.config
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = tokenizer if tokenizer is not None else _maybe_tokenizer(config)
        self.scheduler = Scheduler(
            self.runner.blocks, config.max_num_seqs, config.max_num_batched_tokens,
            scratch=config.max_draft_tokens + 1 if config.max_draft_tokens else 0,
        )
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()

    @property
    def blocks(self):
        return self.runner.blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> None:
        """Validate and queue a request. Raises InvalidRequest / CapacityExhausted; on error
        nothing is queued and other requests are unaffected."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            stop_ids=self._stop_ids(params),
            max_len=self.max_model_len,
            generator=make_generator(params, self.runner.device),
            arrival=next(self._arrivals),
        )
        if self.tokenizer is not None:
            from specserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

            seq.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            seq.stopper = StopStringMatcher(params.stop) if params.stop else None
        elif params.stop:
            raise InvalidRequest("stop strings need a tokenizer; this engine has none")
        self.scheduler.add(seq)
        self.requests[request_id] = seq

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a tokenizer; send token ids instead")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:8]}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(at least one generated token must fit)"
            )
        return ids

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
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
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch; return outputs of requests that advanced."""
        work = self.scheduler.schedule()
        if not work:
            return []
        inputs = [self._input(w) for w in work]
        ends = list(itertools.accumulate(w.num_tokens for w in work))
        sampling = [i for i, w in enumerate(work) if w.start + w.num_tokens == w.seq.num_tokens]
        logits, _ = self.runner.forward(inputs, [ends[i] - 1 for i in sampling])
        for w in work:
            w.seq.num_computed += w.num_tokens
        outputs = []
        for row, i in enumerate(sampling):
            seq = work[i].seq
            token = sample_rows(logits[row : row + 1], seq.params, seq.generator)[0]
            outputs.append(self._commit(seq, [token]))
        return outputs

    def _input(self, w: Scheduled) -> ForwardInput:
        ids = w.seq.all_ids[w.start : w.start + w.num_tokens]
        return ForwardInput(
            w.seq.request_id, ids, range(w.start, w.start + w.num_tokens), ctx_len=w.start
        )

    def _commit(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append generated tokens (stopping at the first that ends the request)."""
        reason, taken = None, []
        for t in tokens:
            taken.append(t)
            reason = seq.append(t)
            if reason is not None:
                break
        text, reason = self._text(seq, taken, reason)
        out = RequestOutput(
            seq.request_id, taken, text, reason, len(seq.prompt_ids), len(seq.output_ids)
        )
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        return out

    def _text(self, seq: Sequence, taken: list[int], reason: FinishReason | None):
        if seq.detok is None:
            return "", reason
        delta = seq.detok.push(taken)
        if reason is not None:
            delta += seq.detok.flush()
        if seq.stopper is not None:
            delta, stopped = seq.stopper.feed(delta)
            if stopped:
                return delta, FinishReason.STOP
            if reason is not None:
                delta += seq.stopper.flush()
        return delta, reason

    # ---- convenience -------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[str | Seq[int]], params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; returns each request's generated token ids."""
        ids = []
        for i, p in enumerate(prompts):
            rid = f"gen-{next(self._arrivals)}-{i}"
            self.add_request(rid, p, params)
            ids.append(rid)
        got: dict[str, list[int]] = {r: [] for r in ids}
        while self.has_unfinished:
            for out in self.step():
                got[out.request_id].extend(out.new_token_ids)
        return [got[r] for r in ids]


def _maybe_tokenizer(config: EngineConfig):
    if not (Path(config.model_dir) / "tokenizer.json").exists():
        return None
    from specserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(config.model_dir)


__all__ = ["Engine", "Status"]
