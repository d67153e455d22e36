"""Traces and metrics plumbing shared by the three services (no span or metric names here).

Tracing: `setup_tracing(name)` installs one SDK `TracerProvider` per process with resource
`service.name` = `OTEL_SERVICE_NAME` or `name`. Spans are exported over OTLP/gRPC (batched, on
the SDK's own thread) when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and appended as JSON lines to
`$SPECSERVE_TRACE_DIR/<service.name>.jsonl` when that is set (the local demo's traces); otherwise
they are made but go nowhere. `OTEL_SDK_DISABLED=true` leaves the no-op API tracer in place.
W3C trace context crosses every hop explicitly: gRPC metadata between gateway and verifier
(`inject_metadata` / `extract_metadata`), and each `DraftEntry.trace_context` map on the shared
drafter stream (`inject_map` / `extract_map`). Nothing here attaches a context to the current
task: async generators and the engine thread pass contexts by hand. `shutdown_tracing()` flushes
off the event loop (the exporter blocks) at graceful stop.

Metrics: prometheus_client registries, one per running service, served over HTTP by
`start_metrics_server` (port 0 = no endpoint).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
_provider = None  # the process's SDK TracerProvider, once set up
_exporting = False  # whether spans go anywhere (an OTLP endpoint or SPECSERVE_TRACE_DIR)

# Latency buckets in SECONDS: 100 µs … 60 s (a CPU toy step is ~ms, a 128k prefill is seconds).
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def setup_tracing(service_name: str):
    """Install the process's TracerProvider (idempotent); returns it (None if disabled)."""
    global _provider, _exporting
    if _provider is not None:
        return _provider
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    # shutdown_on_exit=False: `shutdown_tracing` bounds the flush; an atexit hook could block
    # the exit for as long as the exporter keeps retrying an unreachable collector
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}),
                              shutdown_on_exit=False)
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if endpoint:
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol != "grpc":
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only grpc is supported; using grpc",
                        protocol)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=endpoint,
                                    insecure=not endpoint.startswith("https://"))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _exporting = True
        log.info("exporting traces as %r to %s", name, endpoint)
    if os.environ.get("SPECSERVE_TRACE_DIR"):
        _export_to_file(provider, Path(os.environ["SPECSERVE_TRACE_DIR"]), name)
        _exporting = True
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def _export_to_file(provider, directory: Path, name: str) -> None:
    """Append every finished span, one JSON object per line, to `directory/<name>.jsonl`."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.jsonl"
    out = path.open("a", encoding="utf-8", buffering=1)
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(None) + "\n")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("writing traces as %r to %s", name, path)


def exporting() -> bool:
    """True once `setup_tracing` installed an exporter: trace ids then lead somewhere."""
    return _exporting


def trace_id_of(span) -> str | None:
    """The span's trace id as 32 hex digits (what Jaeger's /trace/<id> takes); None if unsampled."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid and ctx.trace_flags.sampled else None


def tracer(name: str) -> trace.Tracer:
    """A tracer of the process's provider (the no-op one until `setup_tracing`)."""
    return trace.get_tracer(name)


async def shutdown_tracing(timeout_s: float = 3.0) -> None:
    """Export what is buffered and stop the exporter, off the event loop (the exporter blocks,
    and may be sending to a server on this very loop), giving up after about `timeout_s`: an
    unreachable collector must not hold up a graceful stop."""
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    done = threading.Event()

    def flush_and_stop() -> None:
        try:
            provider.force_flush(int(timeout_s * 1000))
            provider.shutdown()
        finally:
            done.set()

    threading.Thread(target=flush_and_stop, name="otel-shutdown", daemon=True).start()
    if not await asyncio.to_thread(done.wait, timeout_s + 1.0):
        log.warning("spans not flushed within %.1f s (collector unreachable?)", timeout_s)


# ---- W3C trace context -----------------------------------------------------------------------
def inject_map(context: Context | None) -> dict[str, str]:
    """{"traceparent": ..., ["tracestate": ...]} of the span current in `context` ({} if none)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def traceparent(span_context: trace.SpanContext) -> dict[str, str]:
    """`inject_map` for one span context, formatted directly (the per-step hot path)."""
    if not span_context.is_valid:
        return {}
    carrier = {"traceparent": f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
                              f"{int(span_context.trace_flags):02x}"}
    if span_context.trace_state:
        carrier["tracestate"] = span_context.trace_state.to_header()
    return carrier


def extract_map(carrier: Mapping[str, str] | None) -> Context:
    """The context to parent spans on (empty: a new trace starts)."""
    return _PROPAGATOR.extract(dict(carrier or {}))


def inject_metadata(context: Context | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `context`'s span."""
    return tuple(inject_map(context).items())


def extract_metadata(metadata: Iterable | None) -> Context:
    """The context sent by the caller in gRPC metadata (`context.invocation_metadata()`)."""
    carrier = {}
    for item in metadata or ():
        key, value = item
        if key in ("traceparent", "tracestate") and isinstance(value, str):
            carrier[key] = value
    return extract_map(carrier)


# ---- Prometheus --------------------------------------------------------------------------------
def start_metrics_server(registry, host: str, port: int):
    """Serve `registry` on http://host:port/metrics in a daemon thread; returns the server
    (None when port is 0). A port in use is an error, as for the service's own ports: another
    process's /metrics there would be scraped as this one's."""
    if not port:
        return None
    from prometheus_client import start_http_server

    from services.common.server import bind_problem

    why = bind_problem(host, port)  # the reason in our words
    try:
        if why is None:
            server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        raise OSError(f"could not bind {host}:{port} for /metrics ({why})")
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server


def stop_metrics_server(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
