"""`Gateway.Generate`: validate, tokenize, relay the verifier's steps as text chunks, final stats.

Thin: convert → call the verifier → convert. The gateway owns what needs text: tokenizing the
prompt, incremental detokenization and stop strings (a completed stop string cancels the
verifier stream, which frees the request there). Verifier errors keep their status code and
message; a client cancel cancels the verifier call.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.errors import status_for
from services.gateway import convert
from services.gateway.convert import GatewayFinal, GatewayRequest, Step, VerifierFinal
from specserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from specserve.errors import InvalidRequest, SpecServeError
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FinishReason
from specserve.v1 import gateway_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("specserve.gateway")
_TOKENIZE_OFF_LOOP_CHARS = 16_384  # longer prompts are tokenized in a worker thread


class _RequestState:
    """Per-request detokenizer, stop-string matcher and the stats seen so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], req: GatewayRequest) -> None:
        self.req, self.prompt_tokens = req, len(prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stopper = StopStringMatcher(req.params.stop) if req.params.stop else None
        self.stats = RequestSpecStats()
        self.completion_tokens = 0
        self.t0 = time.perf_counter()
        self.ttft_s = 0.0

    def push(self, step: Step) -> tuple[str, bool]:
        """Text for a step's tokens (cut at a stop string) and whether a stop string completed."""
        if not self.ttft_s:
            self.ttft_s = time.perf_counter() - self.t0
        if self.completion_tokens:  # the first event is prefill's sampled token, not a step
            _record(self.stats, step)
        self.completion_tokens += len(step.token_ids)
        return self._stop(self.detok.push(step.token_ids))

    def tail(self) -> tuple[str, bool]:
        """Held-back text at the end of generation."""
        text, stopped = self._stop(self.detok.flush())
        if self.stopper is not None and not stopped:
            text += self.stopper.flush()
        return text, stopped

    def _stop(self, delta: str) -> tuple[str, bool]:
        return (delta, False) if self.stopper is None else self.stopper.feed(delta)

    def final(self, reason: FinishReason | None, v: VerifierFinal | None) -> GatewayFinal:
        """The verifier's usage and stats when it finished the request, ours when we cut it."""
        wall = time.perf_counter() - self.t0
        if v is None:
            return GatewayFinal(reason, self.prompt_tokens, self.completion_tokens, self.stats,
                                0.0, self.req.request_id, self.ttft_s, wall)
        return GatewayFinal(reason, v.prompt_tokens, v.completion_tokens, v.stats, v.other_s,
                            self.req.request_id, self.ttft_s, wall)


def _record(stats: RequestSpecStats, step: Step) -> None:
    """Accumulate a step (the verifier's own stats replace these when it finishes the request)."""
    stats.steps += 1
    stats.draft_tokens += step.tree_size
    stats.accepted_tokens += step.accepted_depth
    stats.committed_tokens += step.commit_len
    stats.commit_len_hist[step.commit_len] += 1
    for depth in range(1, step.accepted_depth + 1):
        stats.accepted_per_position[depth] += 1
    if step.fallback:
        stats.fallbacks[step.fallback] += 1


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, verifier: grpc.aio.Channel,
                 default_timeout_s: float) -> None:
        self._tokenizer = tokenizer
        self._verifier = verifier_pb2_grpc.VerifierStub(verifier)
        self._default_timeout_s = default_timeout_s

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            req = convert.request_from_pb(request)
            prompt_ids = await self._prompt_ids(req)
            state = _RequestState(self._tokenizer, prompt_ids, req)
        except SpecServeError as e:
            await context.abort(status_for(e), str(e))
        call = self._verifier.Generate(convert.verify_request_to_pb(req, prompt_ids),
                                       timeout=self._timeout(context))
        context.add_done_callback(lambda _ctx: call.cancel())  # client cancel → verifier cancel
        try:
            async for response in self._relay(call, state):
                yield response
        except grpc.aio.AioRpcError as e:
            log.info("request %s: verifier %s: %s", req.request_id, e.code().name, e.details())
            await context.abort(e.code(), e.details() or e.code().name)
        except SpecServeError as e:
            await context.abort(status_for(e), str(e))
        finally:
            call.cancel()

    async def _relay(self, call, state: _RequestState):
        async for event in call:
            step, final = convert.event_from_pb(event)
            if step is not None:
                text, stopped = state.push(step)
                yield convert.chunk_to_pb(text, step)
                if stopped:
                    call.cancel()  # the verifier frees the request's pages
                    yield convert.final_to_pb(state.final(FinishReason.STOP, None))
                    return
            if final is not None:
                text, stopped = state.tail()
                if text:
                    yield convert.chunk_to_pb(text, None)
                reason = FinishReason.STOP if stopped else final.finish_reason
                yield convert.final_to_pb(state.final(reason, final))
                return
        raise SpecServeError("the verifier stream ended without a final event")

    async def _prompt_ids(self, req: GatewayRequest) -> list[int]:
        if req.token_ids is not None:
            return self._tokenizer.check_ids(req.token_ids)
        if len(req.text) > _TOKENIZE_OFF_LOOP_CHARS:
            ids = await asyncio.to_thread(self._tokenizer.encode, req.text)
        else:
            ids = self._tokenizer.encode(req.text)
        if not ids:
            raise InvalidRequest("prompt text encodes to no tokens")
        return ids

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self._default_timeout_s if remaining is None else max(remaining, 0.001)
