"""The Verifier gRPC servicer: thin — convert, hand to the step loop, convert back.

`Generate` streams one VerifyEvent per step that committed tokens for the request (the last one
carries `final`); core errors map to status codes through services/common/errors. A cancelled
or expired stream aborts its request, so its KV pages (and drafter state) are freed at once.
"""

from __future__ import annotations

import itertools
import time

import grpc

from services.common.errors import status_for
from services.verifier import convert
from services.verifier.loop import StepEvent, StepLoop
from specserve.v1 import verifier_pb2_grpc


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, limits: convert.SpecLimits) -> None:
        self.limits = limits
        self.loop: StepLoop | None = None  # set by `attach` once the model is loaded
        self.drafter = None
        self._ids = itertools.count()

    def attach(self, loop: StepLoop, drafter=None) -> None:
        self.loop, self.drafter = loop, drafter

    async def Generate(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        t0 = time.perf_counter()
        try:
            args = convert.generate_args_from_pb(request, self.limits,
                                                 f"verify-{next(self._ids)}")
            events = await self.loop.submit(args.request_id, args.prompt_ids, args.params,
                                            args.budget, args.drafter_kind)
        except Exception as e:  # InvalidRequest, CapacityExhausted, ...
            await context.abort(status_for(e), str(e))
        finished, error = False, None
        try:
            while not finished:
                item = await events.get()
                if isinstance(item, BaseException):
                    error = item
                    break
                finished = item.output.finished
                yield self._event(item, t0)
        finally:  # cancelled, deadline expired or failed: free the request now
            if not finished:
                self.loop.abort(args.request_id, owner=events)
        if error is not None:
            await context.abort(status_for(error), str(error))

    @staticmethod
    def _event(item: StepEvent, t0: float):
        event = convert.step_event_to_pb(item.output.new_token_ids, item.step)
        if item.output.finished:
            convert.final_to_pb(event, item.output, item.stats, time.perf_counter() - t0)
        return event

    async def Stats(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        connected = self.drafter is not None and self.drafter.connected
        return convert.stats_to_pb(self.loop.stats(), connected)
