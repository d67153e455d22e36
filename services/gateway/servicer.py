"""`Gateway.Generate`: the gRPC front of the gateway's pipeline (services/gateway/pipeline.py).

Thin: convert → run the pipeline → convert. Errors abort with the pipeline's status code and
message; a client cancel cancels the verifier call. When spans are exported, the request's trace
id goes back to the client as initial metadata `x-specserve-trace-id`.
"""

from __future__ import annotations

import contextlib

from services.common import telemetry
from services.gateway import convert
from services.gateway.pipeline import GenerationFailed, Pipeline, TextChunk
from specserve.v1 import gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        span = self.pipeline.start_span(context.invocation_metadata())
        if request.request_id:  # named even if the request is refused
            span.set_attribute("request.id", request.request_id[:200])
        trace_id = telemetry.trace_id_of(span) if telemetry.exporting() else None
        if trace_id is not None:  # the client can print where the request's trace is
            await context.send_initial_metadata(((convert.TRACE_ID_KEY, trace_id),))
        events = self.pipeline.run(
            lambda: convert.request_from_pb(request, self.pipeline.defaults), span,
            context.time_remaining(), "grpc", context.add_done_callback)
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    yield convert.chunk_to_pb(event.text, event.step) \
                        if isinstance(event, TextChunk) else convert.final_to_pb(event)
            except GenerationFailed as e:
                await context.abort(e.code, e.message)
