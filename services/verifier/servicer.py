"""The Verifier gRPC servicer: thin — convert, hand to the request lifecycle, convert back.

`Generate` streams one VerifyEvent per step that committed tokens for the request (the last one
carries `final`); `Stop` ends a running request early as finished (the gateway matched a stop
string; it cancels the call next). The request's span, its queue on the step loop, freeing it
when the call ends early and its metrics are `requests.Requests`'; a failure is aborted with
its status code (services/common/errors). The caller's span context comes in the call
metadata (W3C `traceparent`).
"""

from __future__ import annotations

import contextlib
import itertools

import grpc

from services.common import telemetry
from services.verifier import convert
from services.verifier.loop import StepLoop
from services.verifier.requests import RequestFailed, Requests
from specserve.v1 import verifier_pb2, verifier_pb2_grpc


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, limits: convert.SpecLimits, metrics=None) -> None:
        self.limits = limits
        self.requests = Requests(metrics)
        self.drafter = None
        self._ids = itertools.count()

    @property
    def loop(self) -> StepLoop | None:
        return self.requests.loop

    def attach(self, loop: StepLoop, drafter=None) -> None:
        """The model is loaded: requests go to `loop`."""
        self.requests.loop, self.drafter = loop, drafter

    async def Generate(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        request_id = f"verify-{next(self._ids)}"  # when the request names none
        outputs = self.requests.run(
            lambda: convert.generate_args_from_pb(request, self.limits, request_id),
            telemetry.extract_metadata(context.invocation_metadata()), context.time_remaining)
        try:
            async with contextlib.aclosing(outputs):
                async for item, wall_s in outputs:
                    yield convert.verify_event_to_pb(item, wall_s)
        except RequestFailed as e:
            await context.abort(e.code, e.message)

    async def Stop(self, request, context):
        return verifier_pb2.StopReply(stopped=self.loop is not None
                                      and self.requests.stop(request.request_id))

    async def Stats(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        connected = self.drafter is not None and self.drafter.connected
        transport = self.drafter.transport if connected else ""
        rows = dict(self.drafter.context_rows) if self.drafter is not None else {}
        profile = dict(self.loop.profile) | (dict(self.drafter.profile) if self.drafter else {})
        engine = self.loop.engine  # adaptive's cost model: read between steps, on their thread
        cost = await self.loop.call(engine.cost.table) if engine.adaptive is not None else {}
        return convert.stats_to_pb(self.loop.stats(), connected, transport, rows, profile, cost)

