"""An in-process OTLP/gRPC trace receiver (what Jaeger's :4317 is), for tests and benches.

It runs a grpc.aio server on 127.0.0.1:0 on its own event loop in a daemon thread, so
exporters in other processes can deliver at any time, whatever the caller's loop is doing.
Every received span is kept as `Received(service, span)` (`span` is the OTLP protobuf Span).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Received:
    service: str
    span: object  # opentelemetry.proto.trace.v1.trace_pb2.Span


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    async def Export(self, request, context):  # noqa: N802
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "?")
            got += [Received(service, span) for ss in rs.scope_spans for span in ss.spans]
        with self.sink.lock:
            self.sink.received.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[Received] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="otlp-sink", daemon=True)

    def start(self) -> OtlpSink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the OTLP sink did not start")
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def clear(self) -> None:
        with self.lock:
            self.received.clear()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[Received]:
        """Poll until `predicate(spans)` is true; returns the spans (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans incomplete after {timeout_s} s ({len(spans)} got)")
            time.sleep(0.05)

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)
